"""The prefix cache as a store, in the pure-Python KV bookkeeping: cache salts, public
prefixes, miss reasons with exact token counts, reset, and the events it records."""

from __future__ import annotations

from kv_requests import make_request

from kvserve.kv.cache_manager import KVCacheManager
from kvserve.kv.events import AllBlocksCleared, BlockRemoved, BlockStored

BS = 4


def make(num_blocks=16, **kw) -> KVCacheManager:
    return KVCacheManager(num_blocks, block_size=BS, extra_key=b"float32", **kw)


def run(
    cm: KVCacheManager,
    request_id: str,
    tokens: list[int],
    salt: str | None = None,
    keep: bool = False,
) -> int:
    """Admit, compute and (unless `keep`) free one request; returns its cached tokens."""
    request = make_request(cm, request_id, tokens, salt)
    hit = cm.find_cached_prefix(request)
    assert cm.allocate_slots(request_id, hit.num_tokens, len(tokens) - hit.num_tokens, hit)
    cm.record_prefix_query(request, hit.num_tokens)
    cm.cache_full_blocks(request, len(tokens))
    if not keep:
        cm.free(request_id)
    cm.check_invariants()
    return hit.num_tokens


PROMPT = list(range(100, 113))  # 3 full blocks + 1 token


def test_salts_never_share_a_block_and_the_same_salt_does():
    cm = make()
    assert run(cm, "a", PROMPT, "tenant-a") == 0
    assert run(cm, "b", PROMPT, "tenant-b") == 0
    assert run(cm, "c", PROMPT) == 0  # no salt is a namespace of its own
    assert run(cm, "d", PROMPT, "tenant-a") == 12
    assert run(cm, "e", PROMPT) == 12


def test_public_prefix_blocks_are_shared_across_salts_and_nothing_after():
    system = list(range(100, 110))  # 2 full blocks + 2 tokens of a public prefix
    cm = make(public_prefixes=[system])
    tenant_a = system + [1, 2, 3, 4, 5, 6, 7]  # block 2 mixes the prefix end and tenant text
    assert run(cm, "a", tenant_a, "tenant-a") == 0
    assert run(cm, "b", system + [9, 9, 9, 9, 9], "tenant-b") == 8  # the two public blocks
    assert run(cm, "c", tenant_a, "tenant-b") == 8  # block 2 holds tenant text: salted
    assert run(cm, "d", tenant_a, "tenant-a") == 16
    assert run(cm, "e", tenant_a) == 8  # unsalted requests share the public blocks too


def test_miss_reasons_have_exact_token_counts():
    cm = make(num_blocks=6, report_cross_salt_misses=True)
    stats = cm.prefix_stats
    run(cm, "a", PROMPT, "x")
    # 13 tokens: 3 blocks never seen (12 tokens) + the last token below the block size.
    assert stats.misses == {"below_block_size": 1, "isolated": 0, "evicted": 0, "never_seen": 12}
    run(cm, "b", PROMPT, "y")  # the same tokens under another salt
    assert stats.misses["isolated"] == 12 and stats.misses["below_block_size"] == 2
    run(cm, "c", PROMPT[:8], "x")  # ends on a block boundary: the whole last block is the tail
    assert stats.hits == 4 and stats.misses["below_block_size"] == 6
    run(cm, "big", list(range(500, 524)))  # 6 new blocks evict every cached one
    run(cm, "d", PROMPT, "x")
    assert stats.misses["evicted"] == 12
    assert stats.queries == stats.hits + sum(stats.misses.values())


def test_another_salts_prompt_is_not_told_apart_from_a_new_one_by_default():
    """A tenant reading the miss reasons learns nothing of another salt's prompts: the same
    tokens sent under another salt (or none) count exactly as tokens nobody sent."""
    counts = []
    for earlier_salt in ("other-tenant", None):
        cm = make(num_blocks=6)
        run(cm, "earlier", PROMPT, earlier_salt)
        before = dict(cm.prefix_stats.misses)
        run(cm, "probe", PROMPT, "prober")
        counts.append({k: v - before[k] for k, v in cm.prefix_stats.misses.items()})
    fresh = make(num_blocks=6)
    run(fresh, "probe", PROMPT, "prober")
    nobody = dict(fresh.prefix_stats.misses)
    assert counts == [nobody, nobody]
    assert nobody == {"below_block_size": 1, "isolated": 0, "evicted": 0, "never_seen": 12}


def test_another_kv_dtypes_store_still_counts_as_isolated():
    cm = make(num_blocks=6)
    other = KVCacheManager(6, block_size=BS, extra_key=b"int8")
    hashes = make_request(other, "k", PROMPT).block_hashes
    assert hashes is not None
    cm.note_isolated(hashes.contents, hashes.keys)
    run(cm, "a", PROMPT)
    assert cm.prefix_stats.misses["isolated"] == 12


def test_a_block_behind_a_miss_takes_the_reason_of_the_miss():
    cm = make(num_blocks=4)
    tokens = list(range(12)) + [99]
    run(cm, "a", tokens)  # caches 3 blocks, freed tail first: LRU order 2, 1, 0
    cm.allocate_slots("x", 0, 4)  # evicts block 2 only: the chain's tail
    cm.free("x")
    before = dict(cm.prefix_stats.misses)
    cm.reset_prefix_cache()  # drops 0 and 1 as well: all three were cached and removed
    run(cm, "b", tokens)
    assert cm.prefix_stats.misses["evicted"] - before["evicted"] == 12


def test_reset_drops_unused_cached_blocks_only():
    cm = make(enable_events=True)
    run(cm, "a", PROMPT)
    run(cm, "b", list(range(300, 309)), keep=True)  # 2 cached blocks held by b
    cm.take_events()
    keys = _keys(cm, "k", PROMPT)
    assert cm.reset_prefix_cache() == 3
    assert cm.take_events() == [BlockRemoved(keys[::-1])]  # least recently used first
    assert run(cm, "c", PROMPT) == 0
    cm.free("b")
    cm.take_events()
    assert cm.reset_prefix_cache() == 5  # b's 2 blocks + c's 3
    assert cm.take_events() == [AllBlocksCleared()]


def _keys(cm: KVCacheManager, request_id: str, tokens: list[int]) -> list[bytes]:
    """The keys of the full blocks of `tokens` (no salt)."""
    hashes = make_request(cm, request_id, tokens).block_hashes
    assert hashes is not None
    return hashes.keys


def test_events_batch_consecutive_stored_blocks_and_evictions():
    cm = make(num_blocks=3, enable_events=True)
    run(cm, "a", list(range(9)))
    keys = _keys(cm, "k", list(range(9)))
    [stored] = cm.take_events()
    assert stored == BlockStored(keys, None, list(range(8)), BS)
    run(cm, "b", list(range(50, 62)))  # needs all 3 blocks: evicts both cached ones
    events = cm.take_events()
    assert events[0] == BlockRemoved([keys[1], keys[0]])  # tail first
    assert isinstance(events[1], BlockStored) and len(events[1].block_hashes) == 3


def test_new_blocks_for_persistence_and_cold_blocks_load_as_free_cached():
    cm = make(track_new_blocks=True, enable_events=True)
    run(cm, "a", PROMPT)
    [stored] = cm.take_events()  # one event for the run of 3 blocks, its own token list
    assert stored.token_ids == PROMPT[:12]
    new = cm.take_new_blocks()
    assert [b.token_ids for b in new] == [PROMPT[0:4], PROMPT[4:8], PROMPT[8:12]]
    assert new[1].parent_key == new[0].key and new[0].parent_key is None
    other = make()
    ids = other.load_cold_blocks([b.key for b in new], [b.content for b in new])
    assert ids == [0, 1, 2] and other.pool.num_free_blocks == 16
    assert other.load_cold_blocks([new[0].key], [new[0].content]) == [-1]  # already cached
    assert run(other, "b", PROMPT) == 12
