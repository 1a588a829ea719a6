"""BlockPool and KVCacheManager with exact block ids, ref counts and eviction order."""

from __future__ import annotations

import pytest
from kv_requests import make_request

from kvserve.kv.block_hasher import hash_block
from kvserve.kv.block_pool import BlockPool
from kvserve.kv.cache_manager import KVCacheManager


def test_allocate_takes_uncached_first_then_lru_cached():
    pool = BlockPool(4)
    a = pool.allocate(2)
    assert a == [0, 1]
    pool.cache(0, b"h0")
    pool.cache(1, b"h1")
    pool.free([1, 0])  # tail first: 1 then 0 join the cached LRU queue
    assert pool.num_free_blocks == 4
    assert pool.allocate(2) == [2, 3]  # never-used blocks before any cached one
    assert pool.allocate(1) == [1]  # then the least recently freed cached block
    assert pool.lookup(b"h1") is None and pool.lookup(b"h0") == 0
    assert pool.num_evictions == 1
    pool.check_invariants()


def test_touch_revives_free_cached_block_and_double_free_raises():
    pool = BlockPool(2)
    [b] = pool.allocate(1)
    pool.cache(b, b"x")
    pool.free([b])
    pool.touch([b])
    assert pool.blocks[b].ref_cnt == 1 and pool.num_free_blocks == 1
    pool.free([b])
    with pytest.raises(ValueError, match="double free"):
        pool.free([b])
    pool.check_invariants()


def test_allocate_more_than_free_raises():
    pool = BlockPool(3)
    with pytest.raises(ValueError, match="need 4 blocks, have 3"):
        pool.allocate(4)


def test_hash_chain_depends_on_parent_tokens_and_extra_key():
    h1 = hash_block(None, [1, 2, 3, 4])
    assert hash_block(h1, [5, 6]) != hash_block(None, [5, 6])
    assert hash_block(None, [1, 2, 3, 4], b"int8") != h1
    assert hash_block(None, [1, 2, 3, 4]) == h1
    assert len(h1) == 32  # SHA-256


def make_manager(num_blocks=8, caching=True):
    return KVCacheManager(num_blocks, block_size=4, enable_caching=caching)


def test_allocate_slots_grows_one_block_at_a_time():
    cm = make_manager()
    assert cm.allocate_slots("a", 0, 5) == [0, 1]
    assert cm.allocate_slots("a", 5, 3) == []  # 8 tokens still fit in 2 blocks
    assert cm.allocate_slots("a", 8, 1) == [2]
    assert cm.block_tables["a"] == [0, 1, 2]
    cm.check_invariants()


def test_allocate_slots_is_all_or_nothing():
    cm = make_manager(num_blocks=3)
    cm.allocate_slots("a", 0, 8)
    assert cm.allocate_slots("b", 0, 5) is None
    assert "b" not in cm.block_tables and cm.num_free_blocks == 1
    cm.check_invariants()


def test_shared_prefix_returns_same_blocks_and_counts_references():
    cm = make_manager()
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    cm.allocate_slots("a", 0, 10)
    cm.cache_full_blocks(make_request(cm, "a", prompt), 10)
    hit = cm.find_cached_prefix(make_request(cm, "b", prompt[:8] + [99, 98, 97]))
    assert hit.block_ids == [0, 1] and hit.num_tokens == 8
    cm.allocate_slots("b", 8, 3, hit)
    assert cm.block_tables["b"] == [0, 1, 3]
    assert [cm.pool.blocks[i].ref_cnt for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    cm.free("a")
    assert [cm.pool.blocks[i].ref_cnt for i in (0, 1, 2)] == [1, 1, 0]
    cm.check_invariants()


def test_partial_blocks_are_never_cached_and_last_token_always_computed():
    cm = make_manager()
    prompt = list(range(8))  # exactly 2 full blocks
    cm.allocate_slots("a", 0, 8)
    cm.cache_full_blocks(make_request(cm, "a", prompt), 8)
    cm.free("a")
    # The whole prompt is cached, but its last token must be recomputed: only 1 block is hit.
    hit = cm.find_cached_prefix(make_request(cm, "b", prompt))
    assert hit.num_tokens == 4 and hit.block_ids == [0]
    cm.allocate_slots("c", 0, 6)
    cm.cache_full_blocks(make_request(cm, "c", list(range(100, 106))), 6)
    assert cm.pool.blocks[cm.block_tables["c"][1]].block_hash is None  # 2 of 4 tokens
    cm.check_invariants()


def test_eviction_order_is_lru_and_chain_tail_first():
    cm = make_manager(num_blocks=4)
    cm.allocate_slots("a", 0, 8)
    cm.cache_full_blocks(make_request(cm, "a", list(range(8))), 8)
    cm.allocate_slots("b", 0, 8)
    cm.cache_full_blocks(make_request(cm, "b", list(range(50, 58))), 8)
    cm.free("a")  # frees 1 then 0
    cm.free("b")  # frees 3 then 2
    assert cm.allocate_slots("c", 0, 4) == [1]  # a's tail block goes first
    assert cm.allocate_slots("c", 4, 4) == [0]
    assert cm.allocate_slots("c", 8, 4) == [3]
    hit = cm.find_cached_prefix(make_request(cm, "d", list(range(50, 58)) + [1]))
    assert hit.block_ids == [2] and hit.num_tokens == 4  # b's head block survives
    cm.check_invariants()


def test_free_blocks_hit_by_a_lookup_are_not_counted_twice():
    cm = make_manager(num_blocks=3)
    cm.allocate_slots("a", 0, 8)
    cm.cache_full_blocks(make_request(cm, "a", list(range(8))), 8)
    cm.free("a")
    hit = cm.find_cached_prefix(make_request(cm, "b", list(range(8)) + [7, 7, 7, 7, 7]))
    assert hit.block_ids == [0, 1]
    # b needs 4 blocks: 2 cached (free) + 2 new, but only 3 blocks exist.
    assert cm.allocate_slots("b", 8, 5, hit) is None
    assert all(cm.pool.blocks[i].ref_cnt == 0 for i in range(3))
    cm.check_invariants()


def test_prefix_stats_and_caching_off():
    cm = make_manager(caching=False)
    cm.allocate_slots("a", 0, 8)
    cm.cache_full_blocks(make_request(cm, "a", list(range(8))), 8)
    assert cm.pool.blocks[0].block_hash is None
    b = make_request(cm, "b", list(range(9)))
    assert b.block_hashes is not None and b.block_hashes.keys == []  # off: nothing hashed
    assert cm.find_cached_prefix(b).num_tokens == 0
    cm.record_prefix_query(b, 0)
    assert cm.prefix_stats.queries == 0  # off: nothing looked up, nothing counted
