"""The disk tier below the host tier (--kv-offloading-dir): the bookkeeping (kv/disk_tier.py,
kv/host_tier.py) queues a dropped host slot's write before the slot is reused and a disk hit's
read into a pinned slot before its load; the files (runner/disk_tier.py) give back exactly the
bytes stored, from the writer's queue or from disk, and a restarted server lists them."""

from __future__ import annotations

import pytest
import torch
from kv_requests import make_request
from test_host_tier import A, B, run

from kvserve.attention.kv_cache import allocate_kv_caches
from kvserve.config import CacheConfig
from kvserve.engine.scheduler import _tier_stats
from kvserve.errors import ParameterError
from kvserve.kv.cache_manager import KVCacheManager
from kvserve.kv.disk_tier import DiskTier
from kvserve.kv.host_tier import HostTier
from kvserve.kv.spec import kv_cache_spec
from kvserve.runner.disk_tier import DiskBlocks, block_file, keys_in
from kvserve.step import TierStats


def test_a_dropped_host_entry_is_written_before_its_slot_is_reused_and_lru_files_go():
    host = HostTier(1, "lru", DiskTier(2))
    host.offload(7, b"k0")
    host.take_transfers()
    host.offload(3, b"k1")  # drops k0: its slot 0 goes to disk before k1's offload fills it
    moved = host.take_transfers()
    assert moved.to_disk == [(0, b"k0")] and moved.offloads == [(3, 0)]
    host.offload(4, b"k2")
    host.take_transfers()
    host.offload(5, b"k3")  # the disk holds 2 blocks: k0's file goes (LRU)
    moved = host.take_transfers()
    assert moved.to_disk == [(0, b"k2")] and moved.disk_deletes == [b"k0"]
    assert host.holds(b"k1") and not host.holds(b"k0") and b"k1" not in host


def test_an_entry_dropped_in_the_step_that_offloaded_it_is_written_from_its_device_block():
    host = HostTier(1, "lru", DiskTier(4))
    host.offload(7, b"k0")
    host.offload(3, b"k1")  # k0's bytes are not in slot 0 yet: its device block 7 has them
    moved = host.take_transfers()
    assert moved.device_to_disk == [(7, b"k0")] and moved.to_disk == []
    assert moved.offloads == [(3, 0)]  # k0's offload into slot 0 is dropped with it
    assert host.holds(b"k0") and b"k0" not in host


def test_a_slot_read_from_disk_gets_no_offload_of_the_same_step():
    """The reader thread fills a read's slot while the step's offloads run: an offload queued
    into that slot earlier in the step (its entry dropped for the read) would overwrite part
    of the read's layers.  Found by comparing every cached block with a run without tiers."""
    host = HostTier(1, "lru", DiskTier(4))
    host.offload(7, b"k0")
    host.take_transfers()
    host.offload(3, b"k1")  # k0 goes to disk from slot 0
    host.take_transfers()
    host.offload(5, b"k2")  # k1 goes to disk; k2's offload is queued into slot 0
    assert host.start_read(b"k0") == [b"k2"]  # drops k2: slot 0 is the read's
    moved = host.take_transfers()
    assert moved.from_disk == [(b"k0", 0)] and moved.device_to_disk == [(5, b"k2")]
    assert all(slot != 0 for _, slot in moved.offloads), moved.offloads


def test_a_disk_hit_is_read_into_a_reserved_host_slot_then_loaded():
    cm = KVCacheManager(4, block_size=4, num_host_blocks=2, num_disk_blocks=8, enable_events=True)
    run(cm, "a", A)
    cm.take_host_transfers()
    run(cm, "b", B)  # a's 2 blocks go to the host's 2 slots
    cm.take_host_transfers()
    run(cm, "c", [300 + i for i in range(16)])  # b's blocks take them: a's go to disk first
    moved = cm.take_host_transfers()
    a_keys = cm._full_block_keys(make_request(cm, "x", A))[:2]
    assert sorted(key for _, key in moved.to_disk) == sorted(a_keys)
    # b's first two blocks, dropped in the step that offloaded them, from their device blocks
    assert len(moved.device_to_disk) == 2
    written = {key for _, key in moved.to_disk + moved.device_to_disk}
    assert cm.event_index.keys("DISK") == written  # KV events announced them on DISK
    hit = cm.find_cached_prefix(make_request(cm, "a2", A))
    assert hit.num_tokens == 8 and hit.num_host_tokens == 8  # both from disk, via the host
    assert hit.num_disk_tokens == 8
    assert cm.fetch_disk_hits(hit) is None  # reads started: the request waits
    assert cm.fetch_disk_hits(hit) is None  # still on their way (no second read)
    moved = cm.take_host_transfers()
    assert [key for key, _ in moved.from_disk] == a_keys and not moved.loads
    read_slots = [slot for _, slot in moved.from_disk]
    # the b blocks the reads dropped from the host were written first (not fresh)
    assert {slot for slot, _ in moved.to_disk} == set(read_slots)
    assert cm.host.num_unpinned_slots == 0  # reserved until the reads are reported
    cm.check_invariants()
    cm.finish_disk_reads(a_keys, [])
    assert cm.host.num_unpinned_slots == 2
    assert cm.fetch_disk_hits(hit) == hit  # all in host slots now: admitted
    run(cm, "a2", A)
    tiers = _tier_stats(cm)  # /metrics' figures: the 8 tokens came from disk, via the host
    assert (tiers["device"].hit_tokens, tiers["host"].hit_tokens, tiers["disk"].hit_tokens) == (
        0, 0, 8)  # fmt: skip
    assert tiers["disk"] == TierStats(8, 6, 8, 2, 6)  # 6 files of 8; 2 read, 6 written
    # 2 loads up, 4 offloads in: the 2 whose entries were dropped in their step never ran
    assert tiers["host"] == TierStats(0, 2, 2, 2, 4)
    moved = cm.take_host_transfers()
    # each load copies from the slot its read filled
    assert [slot for _, slot in moved.loads] == read_slots and not moved.from_disk
    stats = cm.prefix_stats
    assert stats.host_hits == 8 and stats.misses["evicted"] == 0
    assert set(a_keys) <= cm.event_index.keys("DISK") & cm.event_index.keys("GPU")
    cm.reset_prefix_cache()
    assert cm.event_index.keys("DISK") == set() and cm.take_host_transfers().disk_deletes


def test_the_disk_tier_needs_the_host_tier():
    with pytest.raises(ParameterError, match="--kv-offloading-dir .*--kv-offloading-size"):
        CacheConfig(kv_offloading_dir="/tmp/x")
    with pytest.raises(ParameterError, match="--kv-offloading-dir-size must be positive"):
        CacheConfig(kv_offloading_size=1.0, kv_offloading_dir="/tmp/x", kv_offloading_dir_size=0)
    with pytest.raises(ParameterError, match="--kv-offloading-backend must be native"):
        CacheConfig(kv_offloading_size=1.0, kv_offloading_backend="lmcache")
    with pytest.raises(ParameterError, match="--kv-offloading-compression must be one of"):
        CacheConfig(kv_offloading_size=1.0, kv_offloading_compression="int4")


def test_block_files_give_back_exactly_the_stored_bytes_and_a_restart_lists_them(tmp_path):
    spec = kv_cache_spec(2, 2, 16, "int8", "float32", 16)
    host = allocate_kv_caches(spec, 4, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    for cache in host:
        cache.write(torch.arange(64), *(torch.randn(64, 2, 16, generator=gen) for _ in range(2)))
    stored = [[t[1].clone() for t in c.tensors] for c in host]
    disk = DiskBlocks(tmp_path, host)
    disk.write([(1, b"\x01\x02"), (2, b"\x03")])
    disk.read([(b"\x01\x02", 3)])  # possibly still queued: read from the queue
    disk.flush()
    assert block_file(tmp_path, b"\x01\x02").is_file()
    assert set(keys_in(tmp_path)) == {b"\x01\x02", b"\x03"}
    for cache in host:
        cache.key[0].zero_()
    disk.read([(b"\x01\x02", 0)])  # from the file now
    for cache, tensors in zip(host, stored, strict=True):
        for table, original in zip(cache.tensors, tensors, strict=True):
            assert torch.equal(table[0], original) and torch.equal(table[3], original)
    disk.delete([b"\x03"])
    disk.close()
    assert keys_in(tmp_path) == [b"\x01\x02"]
