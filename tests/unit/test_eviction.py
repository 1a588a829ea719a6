"""Eviction policies (kv/eviction.py), retention priority and pinned prefixes (kv/pins.py),
driven through the block pool, the host tier and the cache manager with token lists."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from kv_requests import make_request

from kvserve.kv.block_pool import BlockPool
from kvserve.kv.cache_manager import KVCacheManager
from kvserve.kv.eviction import ARCPolicy, PrioritizedEviction
from kvserve.kv.host_tier import HostTier
from kvserve.kv.pins import PinLimitError

BLOCK = 4
SYSTEM = list(range(1000, 1016))  # 4 blocks shared by every "chat" request


def serve(cm: KVCacheManager, request_id: str, token_ids: Sequence[int], priority: int = 35) -> int:
    """Run one request through the cache manager as the scheduler would (prefill all of it,
    cache its full blocks, free it); returns its prefix-cache hit in tokens."""
    request = make_request(cm, request_id, token_ids)
    cached = cm.find_cached_prefix(request)
    num_new = len(token_ids) - cached.num_tokens
    assert cm.allocate_slots(request_id, cached.num_tokens, num_new, cached) is not None
    cm.cache_full_blocks(request, len(token_ids))
    cm.free(request_id, priority)
    cm.take_host_transfers()
    cm.check_invariants()
    return cached.num_tokens


def one_off(i: int) -> list[int]:
    """A prompt no other request shares: 5 full blocks and one token (6 blocks)."""
    return [10_000 + 100 * i + t for t in range(5 * BLOCK + 1)]


def trickle_hits(eviction: str) -> list[int]:
    """8 rounds of: one request with the system prompt (and its own 5 tokens), then a burst
    of 3 one-off prompts, 18 blocks, more than the 16-block cache.  The hits of the shared
    requests, in tokens."""
    cm = KVCacheManager(16, BLOCK, eviction=eviction)
    hits = []
    for r in range(8):
        hits.append(serve(cm, f"chat{r}", SYSTEM + [r, r, r, r, r]))
        for i in range(3):
            serve(cm, f"scan{r}.{i}", one_off(3 * r + i))
    return hits


def test_arc_keeps_a_shared_system_prompt_through_bursts_larger_than_the_cache_lru_does_not():
    """Scan resistance.  ARC: the second request finds the system prompt evicted (it was
    seen once, like the scan), but its recomputation is a ghost hit, so from then on its 4
    blocks are reused ones (T2) and every burst evicts only one-off blocks (T1): 16 of 21
    prompt tokens hit in every later round.  LRU: each burst flushes it, 0 hits."""
    assert trickle_hits("arc") == [0, 0, 16, 16, 16, 16, 16, 16]
    assert trickle_hits("lru") == [0, 0, 0, 0, 0, 0, 0, 0]


def test_a_hit_makes_a_block_reused_and_arc_evicts_the_blocks_seen_once_first():
    pool = BlockPool(4, eviction="arc")
    a, b, c, d = pool.allocate(4)
    for block_id, key in zip((a, b, c, d), (b"a", b"b", b"c", b"d"), strict=True):
        pool.cache(block_id, key)
    pool.free([a, b, c, d])
    pool.touch([a])  # a hit on "a"
    pool.free([a])
    assert pool.blocks[a].reused and not pool.blocks[b].reused
    # LRU would give a first (freed before b, c, d); ARC gives the one-offs, oldest first
    assert pool.allocate(3) == [b, c, d]
    assert pool.lookup(b"a") == a
    pool.check_invariants()


def test_arc_ghost_hits_move_the_target_toward_recency():
    arc = ARCPolicy(capacity=4)
    arc.push(1, b"one", reused=False)
    arc.push(2, b"two", reused=True)
    assert arc.pop() == 1  # T1 first while |T1| > p = 0
    assert arc.note_cached(b"one") and arc.p == 1.0  # B1 ghost hit: recency undervalued
    assert not arc.note_cached(b"one")  # a ghost is used once
    arc.push(3, b"three", reused=False)
    assert arc.pop() == 2  # |T1| = 1 is not above p = 1: T2 gives the victim
    assert arc.note_cached(b"two") and arc.p == 0.0


def test_lower_retention_priority_is_evicted_first_whatever_the_order():
    pool = BlockPool(3, eviction="lru")
    x, y, z = pool.allocate(3)
    for block_id, key in zip((x, y, z), (b"x", b"y", b"z"), strict=True):
        pool.cache(block_id, key)
    pool.free([x], retention_priority=90)
    pool.free([y], retention_priority=10)
    pool.free([z], retention_priority=35)
    assert pool.allocate(2) == [y, z]  # LRU alone would give x first
    pool.check_invariants()
    policy = PrioritizedEviction("arc", 8)
    policy.push("p", b"p", reused=True, priority=0)
    policy.push("q", b"q", reused=False, priority=100)
    assert policy.pop() == ("p", 0)  # the priority outranks reuse


def test_host_tier_keeps_reused_blocks_and_their_priority_when_it_must_drop():
    host = HostTier(2, "arc")
    host.offload(0, b"shared", reused=True)
    host.offload(1, b"once")
    assert host.offload(2, b"scan") == (True, [b"once"])  # LRU would drop "shared"
    host.take_transfers()
    host.pin([b"scan"])  # a load of "scan": it becomes reused too
    host.load(b"scan", 3)
    host.take_transfers()
    host.offload(4, b"low", retention_priority=0)
    assert host.offload(5, b"next") == (True, [b"low"])
    host.check_invariants()


def pin_prefix(cm: KVCacheManager, pin_id: str, token_ids: list[int]):  # noqa: ANN201
    """Pin `token_ids` as the engine does: hashed unsalted, then pinned by their hashes."""
    hashes = cm.block_hasher.for_request(None)
    hashes.extend(token_ids)
    return cm.try_pin_prefix(pin_id, hashes)


def pinned_manager(max_pinned_blocks: int = 4) -> KVCacheManager:
    return KVCacheManager(16, BLOCK, eviction="lru", max_pinned_blocks=max_pinned_blocks)


def test_a_pinned_prefix_is_a_hit_after_a_flood_and_after_a_reset():
    cm = pinned_manager()
    assert pin_prefix(cm, "sys", SYSTEM) is None  # not cached yet: compute it first
    serve(cm, "compute", SYSTEM + [7])
    pin = pin_prefix(cm, "sys", SYSTEM)
    assert pin is not None and pin.num_tokens == 16 and len(pin.block_ids) == 4
    assert cm.num_free_blocks == 12 and cm.pins.num_pinned_blocks == 4
    for i in range(4):  # 24 blocks of one-off prompts through the 12 others, LRU
        serve(cm, f"flood{i}", one_off(i))
    assert serve(cm, "after-flood", SYSTEM + [1, 2]) == 16
    assert cm.reset_prefix_cache() > 0
    assert serve(cm, "after-reset", SYSTEM + [3]) == 16
    cm.reset_prefix_cache(include_pinned=True)
    assert cm.pins.list_pins() == [] and cm.num_free_blocks == 16
    assert serve(cm, "after-unpin", SYSTEM + [4]) == 0


def test_the_pin_cap_counts_distinct_blocks_and_unpin_frees_them():
    cm = pinned_manager(max_pinned_blocks=5)
    long_prefix = SYSTEM + list(range(2000, 2008))  # 6 blocks, SYSTEM's 4 first
    serve(cm, "compute", long_prefix + [9])
    pin_prefix(cm, "sys", SYSTEM)
    with pytest.raises(PinLimitError, match="needs 2 more blocks but 4 of at most 5"):
        pin_prefix(cm, "long", long_prefix)
    assert cm.pins.num_pinned_blocks == 4  # the refused pin held nothing
    again = pin_prefix(cm, "again", SYSTEM[:8])  # its 2 blocks are pinned already
    assert again is not None and cm.pins.num_pinned_blocks == 4
    with pytest.raises(ValueError, match="already in use"):
        pin_prefix(cm, "sys", SYSTEM)
    assert cm.pins.unpin("sys") is not None and cm.pins.num_pinned_blocks == 2
    assert cm.pins.unpin("sys") is None
    cm.check_invariants()
    assert cm.num_free_blocks == 14
