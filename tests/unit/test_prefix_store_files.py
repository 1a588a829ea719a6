"""The prefix cache store on disk with tiny KV tensors (no model): K/V round-trip into cold
cached blocks, a truncated or corrupt group never stops the start-up, another fingerprint is
reported with its reason and left alone, and the size budget deletes the oldest groups."""

from __future__ import annotations

import logging
import os

import torch
from kv_requests import make_request

from kvserve.attention.kv_cache import allocate_kv_caches
from kvserve.engine.prefix_store import PrefixStore, differences, fingerprint
from kvserve.executor.abstract import Executor
from kvserve.kv.cache_manager import KVCacheManager
from kvserve.kv.spec import kv_cache_spec

SPEC = kv_cache_spec(2, 1, 4, "int8", "float32", 4)  # int8: scales travel too
PRINT = {"format": "test", "kv_cache_dtype": "int8", "block_size": "4"}


def engine(num_blocks: int = 8):
    caches = allocate_kv_caches(SPEC, num_blocks, torch.device("cpu"))
    manager = KVCacheManager(num_blocks, 4, extra_key=b"int8", track_new_blocks=True)
    return caches, manager


def cache_prompt(caches, manager, request_id: str, tokens: list[int]) -> None:
    """Compute (random K/V) and cache a prompt, then free it."""
    manager.allocate_slots(request_id, 0, len(tokens))
    for cache in caches:
        for block in manager.block_table(request_id):
            cache.key[block] = torch.randint(-100, 100, cache.key[block].shape, dtype=torch.int8)
            cache.key_scale[block] = torch.rand(cache.key_scale[block].shape)
    manager.cache_full_blocks(make_request(manager, request_id, tokens), len(tokens))
    manager.free(request_id)


def test_blocks_are_indexed_at_start_up_and_read_back_when_a_request_needs_them(tmp_path):
    caches, manager = engine()
    cache_prompt(caches, manager, "a", list(range(9)))  # 2 full blocks
    store = PrefixStore(tmp_path, PRINT, 2**30, caches)
    store.close(manager)
    saved = {b: (caches[1].key[b].clone(), caches[1].key_scale[b].clone()) for b in (0, 1)}

    caches2, manager2 = engine()
    store2 = PrefixStore(tmp_path, PRINT, 2**30, caches2)
    assert store2.index(manager2) == 2
    request = make_request(manager2, "b", list(range(9)))
    assert manager2.find_cached_prefix(request).num_tokens == 0  # indexed, not read
    assert store2.fetch([request], manager2, no_tier_copies) == 2
    hit = manager2.find_cached_prefix(request)
    assert hit.num_tokens == 8 and manager2.pool.num_free_blocks == 8  # cached but free
    for old, new in zip((0, 1), hit.block_ids, strict=True):
        assert torch.equal(caches2[1].key[new], saved[old][0])
        assert torch.equal(caches2[1].key_scale[new], saved[old][1])
    assert store2.fetch([request], manager2, no_tier_copies) == 0  # cached now: no read


def no_tier_copies() -> None:
    raise AssertionError("no tier below the KV cache: nothing to copy")


def test_a_block_evicted_after_its_save_comes_back_from_the_store(tmp_path):
    """While serving: blocks saved, then evicted by others, are read back (evicting the
    least valuable free blocks, never the request's own device hits)."""
    caches, manager = engine(num_blocks=4)
    store = PrefixStore(tmp_path, PRINT, 2**30, caches)
    cache_prompt(caches, manager, "a", list(range(13)))  # 3 full blocks
    store.save(manager)
    store.writer.join()
    saved = {manager.pool.lookup(k): caches[0].key[manager.pool.lookup(k)].clone()
             for k in make_request(manager, "k", list(range(13))).block_hashes.keys}  # fmt: skip
    cache_prompt(caches, manager, "b", list(range(50, 63)))  # evicts 3 of a's blocks
    request = make_request(manager, "c", list(range(13)))
    assert manager.find_cached_prefix(request).num_tokens == 0
    assert store.fetch([request], manager, no_tier_copies) == 3
    hit = manager.find_cached_prefix(request)
    assert hit.num_tokens == 12
    assert [
        torch.equal(caches[0].key[b], k) for b, k in zip(hit.block_ids, saved.values(), strict=True)
    ] == [True] * 3
    store.close(manager)


def test_a_group_gone_when_read_is_a_miss_and_leaves_the_index(tmp_path):
    caches, manager = engine()
    cache_prompt(caches, manager, "a", list(range(9)))
    PrefixStore(tmp_path, PRINT, 2**30, caches).close(manager)
    caches2, manager2 = engine()
    store2 = PrefixStore(tmp_path, PRINT, 2**30, caches2)
    assert store2.index(manager2) == 2
    [group] = tmp_path.glob("*/group-*.safetensors")
    group.unlink()  # another server's budget, say
    request = make_request(manager2, "b", list(range(9)))
    assert store2.fetch([request], manager2, no_tier_copies) == 0
    assert manager2.find_cached_prefix(request).num_tokens == 0
    assert manager2.stored_prefix_keys(request, store2._index) == []  # forgotten
    store2.close(manager2)


def test_a_truncated_group_is_logged_and_deleted(tmp_path, caplog):
    caches, manager = engine()
    cache_prompt(caches, manager, "a", list(range(9)))
    PrefixStore(tmp_path, PRINT, 2**30, caches).close(manager)
    [group] = tmp_path.glob("*/group-*.safetensors")
    os.truncate(group, group.stat().st_size // 2)
    caches2, manager2 = engine()
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        assert PrefixStore(tmp_path, PRINT, 2**30, caches2).index(manager2) == 0
    assert "does not read back" in caplog.text and not group.exists()
    (group.parent / "group-0000000009.safetensors").write_bytes(b"not a safetensors file")
    assert PrefixStore(tmp_path, PRINT, 2**30, caches2).index(manager2) == 0


def test_another_fingerprint_is_reported_and_not_loaded(tmp_path, caplog):
    caches, manager = engine()
    cache_prompt(caches, manager, "a", list(range(9)))
    PrefixStore(tmp_path, PRINT, 2**30, caches).close(manager)
    other = {**PRINT, "kv_cache_dtype": "fp8_e4m3"}
    caches2, manager2 = engine()
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        assert PrefixStore(tmp_path, other, 2**30, caches2).index(manager2) == 0
    assert "kv_cache_dtype: stored int8, now fp8_e4m3" in caplog.text


def test_rotated_caches_fingerprint_what_their_rows_hold(tmp_path):
    """int4 rows written before the keys' channel scales (rotated rows version 1), or before
    the key sink (2), would read back wrong: a rotated dtype's fingerprint names the version,
    the others' do not change."""
    tokenizer = type("Vocab", (), {"get_vocab": lambda self: {"a": 0}})()
    model = tmp_path / "model.gguf"
    model.write_bytes(b"weights")
    rows = Executor.rotated_rows
    prints = {dtype: fingerprint(model, "float32", dtype, 16, "30x3x64", tokenizer, rows(dtype))
              for dtype in ("int4", "k8v4", "int8", "bfloat16")}  # fmt: skip
    assert prints["int4"]["rotated_rows"] == prints["k8v4"]["rotated_rows"] == "3"
    assert "rotated_rows" not in prints["int8"] and "rotated_rows" not in prints["bfloat16"]
    assert prints["int8"] == fingerprint(model, "float32", "int8", 16, "30x3x64", tokenizer)
    old = {**prints["int4"], "rotated_rows": "2"}
    assert differences(old, prints["int4"]) == ["rotated_rows: stored 2, now 3"]


def test_the_size_budget_deletes_the_oldest_groups(tmp_path):
    caches, manager = engine()
    store = PrefixStore(tmp_path, PRINT, 2**30, caches)
    cache_prompt(caches, manager, "a", list(range(9)))
    store.save(manager)
    store.writer.join()
    [first] = tmp_path.glob("*/group-*.safetensors")
    store.writer.max_bytes = first.stat().st_size + 1  # room for one group
    os.utime(first, (1, 1))  # unmistakably the oldest
    cache_prompt(caches, manager, "b", list(range(50, 59)))
    store.close(manager)
    [left] = tmp_path.glob("*/group-*.safetensors")
    assert left != first


def test_with_a_host_tier_the_blocks_a_read_evicts_are_offloaded_before_it_lands(tmp_path):
    """A read back from the store reuses evicted blocks: the host tier's copies of them run
    first (run_tier_copies), so the host holds their old K/V, not the store's."""
    from kvserve.runner.host_transfers import apply_host_transfers

    caches, manager = engine(num_blocks=4)
    host_caches = allocate_kv_caches(SPEC, 4, torch.device("cpu"))
    host_manager = KVCacheManager(4, 4, extra_key=b"int8", track_new_blocks=True,
                                  num_host_blocks=4)  # fmt: skip
    store = PrefixStore(tmp_path, PRINT, 2**30, caches)
    cache_prompt(caches, manager, "a", list(range(13)))
    store.close(manager)
    store = PrefixStore(tmp_path, PRINT, 2**30, caches)
    assert store.index(host_manager) == 3
    cache_prompt(caches, host_manager, "b", list(range(50, 63)))  # 3 cached blocks of b
    b_keys = make_request(host_manager, "k", list(range(50, 63))).block_hashes.keys
    before = {k: caches[0].key[host_manager.pool.lookup(k)].clone() for k in b_keys}

    def run_tier_copies() -> None:
        transfers = host_manager.take_host_transfers()
        apply_host_transfers(caches, host_caches, transfers.offloads, transfers.loads)

    request = make_request(host_manager, "c", list(range(13)))
    assert store.fetch([request], host_manager, run_tier_copies) == 3
    assert host_manager.find_cached_prefix(request).num_tokens == 12
    evicted = [k for k in before if host_manager.pool.lookup(k) is None]
    assert len(evicted) == 2  # the 3 blocks read took the free one and 2 of b's
    for key in evicted:  # which went to the host with their own K/V
        slot = host_manager.host.lookup(key)
        assert slot is not None and torch.equal(host_caches[0].key[slot], before[key])
    store.close(host_manager)
