"""The host tier's bookkeeping (kv/host_tier.py) and its use by the cache manager: which block
goes to which host slot, LRU order, pinning, the copies queued, the hits counted per tier."""

from __future__ import annotations

import pytest
from kv_requests import make_request

from kvserve.config import CacheConfig
from kvserve.errors import ParameterError
from kvserve.kv.cache_manager import KVCacheManager
from kvserve.kv.host_tier import HostTier

A = list(range(100, 109))  # 9 tokens: 2 full blocks of 4 + 1
B = list(range(200, 216))  # 16 tokens: 4 full blocks


def test_offload_fills_free_slots_then_evicts_lru_and_queues_one_copy_per_new_key():
    host = HostTier(2)
    assert host.offload(7, b"k0") == (True, [])
    assert host.offload(3, b"k1") == (True, [])
    assert host.offload(9, b"k0") == (True, [])  # already held: no copy, k0 becomes MRU
    assert host.offload(5, b"k2") == (True, [b"k1"])  # k1 was the LRU entry
    transfers = host.take_transfers()
    assert transfers.offloads == [(7, 0), (5, 1)]  # k2 reuses k1's slot: k1's copy is dropped
    assert transfers.loads == []
    assert host.lookup(b"k0") == 0 and host.lookup(b"k1") is None and host.lookup(b"k2") == 1
    assert host.stats.num_offloaded_blocks == 2 and host.stats.num_dropped_blocks == 1
    host.check_invariants()


def test_a_slot_loaded_this_step_is_never_overwritten_by_an_offload_of_the_same_step():
    host = HostTier(1)
    host.offload(4, b"old")
    host.take_transfers()
    host.pin([b"old"])
    host.load(b"old", 6)
    assert host.offload(2, b"new") == (False, [])  # the only slot is pinned: not kept
    transfers = host.take_transfers()
    assert transfers.loads == [(6, 0)] and transfers.offloads == []
    assert host.offload(2, b"new") == (True, [b"old"])  # unpinned after the step's take
    assert host.take_transfers().offloads == [(2, 0)]


def test_clear_frees_every_slot():
    host = HostTier(3)
    for i, key in enumerate((b"a", b"b")):
        host.offload(i, key)
    assert host.clear() == [b"a", b"b"]
    assert host.num_used_slots == 0 and host.usage == 0.0
    host.check_invariants()


def run(cm: KVCacheManager, request_id: str, tokens: list[int]) -> list[int]:
    """Admit a request as the scheduler does, compute all its tokens, free it."""
    request = make_request(cm, request_id, tokens)
    cached = cm.find_cached_prefix(request)
    new = cm.allocate_slots(request_id, cached.num_tokens, len(tokens) - cached.num_tokens, cached)
    assert new is not None
    cm.record_prefix_query(
        request, cached.num_tokens, cached.num_host_tokens, cached.num_disk_tokens
    )
    table = cm.block_table(request_id)
    cm.cache_full_blocks(request, len(tokens))
    cm.free(request_id)
    cm.check_invariants()
    return table


def test_evicted_blocks_go_to_the_host_and_come_back_on_a_hit():
    cm = KVCacheManager(4, block_size=4, num_host_blocks=4)
    assert run(cm, "a", A) == [0, 1, 2]  # blocks 0 and 1 cached, 2 partial
    cm.take_host_transfers()
    assert run(cm, "b", B) == [3, 2, 1, 0]  # evicts a's blocks, tail first: 1, then 0
    moved = cm.take_host_transfers()
    assert moved.offloads == [(1, 0), (0, 1)] and moved.loads == []
    hit = cm.find_cached_prefix(make_request(cm, "a2", A))
    assert hit.block_ids == [] and hit.num_tokens == 8 and hit.num_host_tokens == 8
    # b was freed tail first: its blocks 0, 1, 2 are the next evicted.  a2's two hits take
    # blocks 0 and 1 (b's content saved to free slots 2 and 3 first), filled from slots 1
    # (a's block 0) and 0 (a's block 1); its third block evicts block 2, whose content takes
    # the least recently used unpinned slot: 2 (a's slots are pinned by the loads), whose
    # queued copy of block 0 is dropped with it.
    assert run(cm, "a2", A) == [0, 1, 2]
    moved = cm.take_host_transfers()
    assert moved.offloads == [(1, 3), (2, 2)]
    assert moved.loads == [(0, 1), (1, 0)]
    stats = cm.prefix_stats
    assert (stats.queries, stats.hits, stats.host_hits) == (9 + 16 + 9, 8, 8)
    assert stats.misses["evicted"] == 0  # nothing was lost: both tiers held it


def test_a_block_dropped_by_both_tiers_is_an_evicted_miss():
    cm = KVCacheManager(4, block_size=4, num_host_blocks=1)
    run(cm, "a", A)
    run(cm, "b", B)  # a's two blocks evicted; the host keeps the last one offloaded: a's 0
    assert cm.find_cached_prefix(make_request(cm, "a2", A)).num_host_tokens == 4
    run(cm, "a2", A)
    assert cm.prefix_stats.host_hits == 4
    assert cm.prefix_stats.misses["evicted"] == 4  # a's block 1: in neither tier


def test_reset_clears_the_host_tier_too():
    cm = KVCacheManager(4, block_size=4, num_host_blocks=4)
    run(cm, "a", A)
    run(cm, "b", B)
    assert cm.host is not None and cm.host.num_used_slots == 2
    cm.reset_prefix_cache()
    assert cm.host.num_used_slots == 0
    assert cm.find_cached_prefix(make_request(cm, "a2", A)).num_tokens == 0


@pytest.mark.parametrize("size", [0.0, -1.0, float("nan")])
def test_the_flag_must_be_a_positive_size(size):
    with pytest.raises(ParameterError, match="--kv-offloading-size must be positive GiB"):
        CacheConfig(kv_offloading_size=size)
