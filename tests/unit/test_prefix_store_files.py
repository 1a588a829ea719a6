"""The prefix cache store on disk with tiny KV tensors (no model): K/V round-trip into cold
cached blocks, a truncated or corrupt group never stops the start-up, another fingerprint is
reported with its reason and left alone, and the size budget deletes the oldest groups."""

from __future__ import annotations

import logging
import os

import torch
from kv_requests import make_request

from kvserve.attention.kv_cache import allocate_kv_caches
from kvserve.engine.prefix_store import PrefixStore
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


def test_blocks_round_trip_into_cold_cached_blocks(tmp_path):
    caches, manager = engine()
    cache_prompt(caches, manager, "a", list(range(9)))  # 2 full blocks
    store = PrefixStore(tmp_path, PRINT, 2**30, caches)
    store.close(manager)
    saved = {b: (caches[1].key[b].clone(), caches[1].key_scale[b].clone()) for b in (0, 1)}

    caches2, manager2 = engine()
    assert PrefixStore(tmp_path, PRINT, 2**30, caches2).load(manager2) == 2
    hit = manager2.find_cached_prefix(make_request(manager2, "b", list(range(9))))
    assert hit.num_tokens == 8 and manager2.pool.num_free_blocks == 8  # cold: cached but free
    for old, new in zip((0, 1), hit.block_ids, strict=True):
        assert torch.equal(caches2[1].key[new], saved[old][0])
        assert torch.equal(caches2[1].key_scale[new], saved[old][1])


def test_a_truncated_group_is_logged_and_deleted(tmp_path, caplog):
    caches, manager = engine()
    cache_prompt(caches, manager, "a", list(range(9)))
    PrefixStore(tmp_path, PRINT, 2**30, caches).close(manager)
    [group] = tmp_path.glob("*/group-*.safetensors")
    os.truncate(group, group.stat().st_size // 2)
    caches2, manager2 = engine()
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        assert PrefixStore(tmp_path, PRINT, 2**30, caches2).load(manager2) == 0
    assert "does not read back" in caplog.text and not group.exists()
    (group.parent / "group-0000000009.safetensors").write_bytes(b"not a safetensors file")
    assert PrefixStore(tmp_path, PRINT, 2**30, caches2).load(manager2) == 0


def test_another_fingerprint_is_reported_and_not_loaded(tmp_path, caplog):
    caches, manager = engine()
    cache_prompt(caches, manager, "a", list(range(9)))
    PrefixStore(tmp_path, PRINT, 2**30, caches).close(manager)
    other = {**PRINT, "kv_cache_dtype": "fp8_e4m3"}
    caches2, manager2 = engine()
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        assert PrefixStore(tmp_path, other, 2**30, caches2).load(manager2) == 0
    assert "kv_cache_dtype: stored int8, now fp8_e4m3" in caplog.text


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
