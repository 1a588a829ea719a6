"""Disk-tier reads off the engine thread (kv/host_tier.py, kv/cache_manager.py, the scheduler,
runner/disk_tier.py): a request whose prefix is on disk waits in the queue while its blocks
are read into reserved host slots and others run; a read that fails (the file gone, another
server's eviction, or corrupt) is a miss that the request recomputes, and nothing else is
cleared; abort and reset while reading keep the slots reserved until the read is reported."""

from __future__ import annotations

import torch
from kv_requests import make_request
from test_host_tier import A, B, run

from kvserve.attention.kv_cache import allocate_kv_caches
from kvserve.engine.scheduler import Scheduler
from kvserve.kv.cache_manager import KVCacheManager
from kvserve.kv.disk_tier import DiskTier
from kvserve.kv.spec import kv_cache_spec
from kvserve.request import Request, RequestStatus, SamplingParams
from kvserve.runner.disk_tier import DiskBlocks, block_file

D = [400 + i for i in range(5)]  # no prefix in common with A


def a_on_disk() -> tuple[Scheduler, list[bytes]]:
    """A scheduler whose cache (4 device blocks, 2 host slots, 8 on disk) has A's 2 full
    blocks on disk only, and their keys."""
    cm = KVCacheManager(4, block_size=4, num_host_blocks=2, num_disk_blocks=8)
    for request_id, tokens in (("a", A), ("b", B), ("c", [300 + i for i in range(16)])):
        run(cm, request_id, tokens)
        cm.take_host_transfers()
    keys = cm._full_block_keys(make_request(cm, "x", A))[:2]
    assert all(key in cm.host.disk and key not in cm.host for key in keys)
    return Scheduler(4, 32, 64, cm), keys


def add(scheduler: Scheduler, request_id: str, prompt: list[int]) -> None:
    scheduler.add_request(Request(request_id, prompt, SamplingParams(max_tokens=1)))


def scheduled(scheduler: Scheduler) -> dict[str, int]:
    """One step of the scheduler (a token for each sampled request): start positions by id."""
    out = scheduler.schedule()
    scheduler.update_from_output(out, {s.request_id: 1 for s in out.scheduled if s.sample})
    scheduler.cache_manager.check_invariants()
    return {s.request_id: s.start_position for s in out.scheduled}


def test_a_request_with_disk_hits_waits_for_its_reads_while_another_runs():
    scheduler, keys = a_on_disk()
    cm = scheduler.cache_manager
    add(scheduler, "a2", A)
    add(scheduler, "d", D)
    out = scheduler.schedule()
    assert [s.request_id for s in out.scheduled] == ["d"]  # a2 waits, d runs
    assert [key for key, _ in out.disk_to_host] == keys and not out.blocks_from_host
    read_slots = [slot for _, slot in out.disk_to_host]
    scheduler.update_from_output(out, {"d": 1})
    assert scheduled(scheduler) == {}  # reads not reported yet: a2 still waits
    scheduler.finish_disk_reads(keys, [])
    out = scheduler.schedule()
    assert [(s.request_id, s.start_position) for s in out.scheduled] == [("a2", 8)]
    assert [slot for _, slot in out.blocks_from_host] == read_slots and not out.disk_to_host
    assert scheduler.requests["a2"].num_cached_tokens == 8
    assert cm.prefix_stats.disk_hits == 8 and cm.host.disk.stats.num_read_blocks == 2


def test_with_one_sequence_slot_the_request_behind_runs_in_the_same_step():
    scheduler, keys = a_on_disk()
    scheduler.max_num_seqs = 1
    add(scheduler, "a2", A)
    add(scheduler, "d", D)
    assert scheduled(scheduler) == {"d": 0}  # a2 is passed over, d takes the slot
    scheduler.finish_disk_reads(keys, [])
    assert scheduled(scheduler) == {"a2": 8}  # d finished (1 token): a2 admitted


def test_abort_while_reading_keeps_the_slots_until_the_reads_land_then_frees_them():
    scheduler, keys = a_on_disk()
    host = scheduler.cache_manager.host
    add(scheduler, "a2", A)
    assert scheduled(scheduler) == {}
    scheduler.finish_request("a2", RequestStatus.FINISHED_ABORTED)
    assert host.num_unpinned_slots == 0  # the reader thread still writes into them
    scheduler.finish_disk_reads(keys, [])
    assert host.num_unpinned_slots == 2 and all(key in host for key in keys)  # evictable
    assert not scheduler._fetching
    host.check_invariants()


def test_a_failed_read_is_recomputed_and_nothing_else_is_cleared():
    scheduler, keys = a_on_disk()
    cm = scheduler.cache_manager
    disk = cm.host.disk
    before = set(disk.keys)
    add(scheduler, "a2", A)
    assert scheduled(scheduler) == {}
    scheduler.finish_disk_reads([keys[0]], [keys[1]])  # keys[1]'s file vanished
    assert scheduled(scheduler) == {"a2": 4}  # block 0 from the host, block 1 recomputed
    assert keys[1] not in disk and disk.stats.num_lost_blocks == 1
    assert before - set(disk.keys) == {keys[1]} and keys[0] in cm.host  # no tier cleared
    assert cm.prefix_stats.disk_hits == 4


def test_reset_while_reading_frees_the_slots_when_the_reads_land_and_the_request_recomputes():
    scheduler, keys = a_on_disk()
    cm = scheduler.cache_manager
    add(scheduler, "a2", A)
    assert scheduled(scheduler) == {}
    cm.reset_prefix_cache()
    assert scheduled(scheduler) == {}  # its slots are still being written: it waits
    scheduler.finish_disk_reads(keys, [])
    assert cm.host.num_used_slots == 0 and cm.host.num_unpinned_slots == 2
    assert scheduled(scheduler) == {"a2": 0}


def test_a_block_file_gone_or_corrupt_is_a_failed_read_not_an_error(tmp_path):
    spec = kv_cache_spec(2, 2, 16, "int8", "float32", 16)
    host = allocate_kv_caches(spec, 4, torch.device("cpu"))
    for cache in host:
        cache.write(torch.arange(64), torch.randn(64, 2, 16), torch.randn(64, 2, 16))
    disk = DiskBlocks(tmp_path, host)
    disk.write([(1, b"\x01"), (2, b"\x02"), (3, b"\x03")])
    disk.flush()
    block_file(tmp_path, b"\x02").unlink()  # another server evicted it after the lookup
    block_file(tmp_path, b"\x03").write_bytes(b"not a safetensors file")
    disk.start_reads([(b"\x01", 0), (b"\x02", 1), (b"\x03", 2)])
    disk.wait_for_slots([0, 1, 2])
    done, failed = disk.take_finished_reads()
    assert done == [b"\x01"] and failed == [b"\x02", b"\x03"]
    assert disk.num_failed_reads == 2 and disk.take_finished_reads() == ([], [])
    for cache in host:
        assert all(torch.equal(table[0], table[1]) for table in cache.tensors)
    disk.close()


def test_the_reads_drops_onto_a_full_disk_never_delete_the_prefixs_own_files():
    """A full disk whose least recently used file is A's second block: the first read's slot
    drops a host entry onto the disk, which deletes a file to make room; the prefix's own
    files go last, so both blocks are read and hit (before, the second file was deleted and
    its read failed an assertion)."""
    cm = KVCacheManager(4, block_size=4, num_host_blocks=2, num_disk_blocks=4)
    for request_id, tokens in (("a", A), ("b", B), ("c", [300 + i for i in range(16)])):
        run(cm, request_id, tokens)
        cm.take_host_transfers()
    keys = cm._full_block_keys(make_request(cm, "x", A))[:2]
    assert cm.host.disk.is_full and cm.host.disk.keys[:2] == [keys[1], keys[0]]
    scheduler = Scheduler(4, 32, 64, cm)
    add(scheduler, "a2", A)
    out = scheduler.schedule()
    assert [key for key, _ in out.disk_to_host] == keys and not out.scheduled
    assert all(key in cm.host.disk for key in keys) and len(out.disk_deletes) == 2
    scheduler.update_from_output(out, {})
    scheduler.finish_disk_reads(keys, [])
    assert scheduled(scheduler) == {"a2": 8}  # both blocks from disk, the last token computed


def test_a_file_another_server_wrote_after_the_start_is_found_and_read(tmp_path):
    """Two servers on one folder: the second listed it before the first wrote A's blocks;
    its lookup finds their files all the same (the probe) and reads them."""
    writer = KVCacheManager(4, block_size=4, num_host_blocks=2, num_disk_blocks=8)
    keys = writer._full_block_keys(make_request(writer, "x", A))[:2]
    folder: set[bytes] = set()  # the files on disk, as the probe sees them
    cm = KVCacheManager(4, block_size=4, num_host_blocks=2, num_disk_blocks=8,
                        disk_probe=folder.__contains__)  # fmt: skip
    assert cm.find_cached_prefix(make_request(cm, "a", A)).num_tokens == 0  # none yet
    folder.update(keys)  # the first server writes them
    scheduler = Scheduler(4, 32, 64, cm)
    add(scheduler, "a2", A)
    out = scheduler.schedule()
    assert [key for key, _ in out.disk_to_host] == keys and not out.scheduled
    assert cm.host.disk.stats.num_found_blocks == 2


def test_the_store_reads_for_the_head_of_the_queue_only_while_a_sequence_slot_is_free():
    cm = KVCacheManager(8, block_size=4)
    scheduler = Scheduler(1, 32, 64, cm)  # one sequence at a time
    add(scheduler, "a", A)
    add(scheduler, "d", D)
    assert [r.request_id for r in scheduler.admissible_head(4)] == ["a", "d"]
    scheduler.schedule()  # a runs: no slot for d
    assert scheduler.admissible_head(4) == []


def test_a_file_found_then_lost_is_not_found_again_until_this_server_stores_it():
    """A file the probe finds but that cannot be read (corrupt, or another rank's share
    missing) is a miss once, not a read retried every step; storing the key ends that."""
    folder = {b"k0"}  # a broken file stays in the folder
    disk = DiskTier(8, probe=folder.__contains__)
    assert disk.find(b"k0") and disk.stats.num_found_blocks == 1
    assert disk.lost(b"k0")
    assert not disk.find(b"k0") and disk.stats.num_found_blocks == 1
    assert disk.store(b"k0") == (True, [])  # this server writes it: known again
    assert disk.find(b"k0")
    assert disk.lost(b"k0") and not disk.find(b"k0")
