"""The disk tier's files (--kv-offloading-dir): the tensor side of kv/disk_tier.py.

    DIR/<fingerprint digest>/<key hex>.safetensors    one block: every distinct host cache's
                                                      tables (K, V, their scales) at that block

The digest is the prefix store's (engine/prefix_store.py: model files, dtypes, block size,
model shape, tokenizer), so servers of one model share blocks and others never read them.
A block is written by a thread of its own (save_file to a temporary name, then an atomic
rename: a reader never sees half a file); the engine thread only copies the host slot's rows
(small: int8 codes by default) into the queue.  Reads are made by a reader thread into host
slots the bookkeeping reserved for them (kv/host_tier.py), while the requests that wait for
them stay queued and the engine thread runs steps; `take_finished_reads` reports them at the
end of each step.  A block still queued for writing is read from the queue.  A file that
vanished (another server on the folder deleted it) or is corrupt is a failed read, logged
once, reported as such: a miss, never a failed step.  Deletions go through the writer thread,
after the writes queued before them.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kvserve.attention.kv_cache import LayerKVCache
from kvserve.runner.host_transfers import apply_host_transfers

logger = logging.getLogger("kvserve")

FILE_SUFFIX = ".safetensors"


def block_file(directory: Path, key: bytes, rank: int = 0) -> Path:
    """Where the disk tier keeps rank `rank`'s share of the block of `key` (the heads of
    that rank: one file per rank with tensor parallelism)."""
    return directory / (key.hex() + (f".rank{rank}" if rank else "") + FILE_SUFFIX)


def keys_in(directory: Path) -> list[bytes]:
    """The keys whose block files `directory` holds (rank 0's), oldest first (by
    modification time): listed, not read, at start-up (a server finds the blocks an earlier
    one wrote)."""
    if not directory.is_dir():
        return []
    entries = []
    for entry in os.scandir(directory):
        name = entry.name
        if name.endswith(FILE_SUFFIX) and not name.startswith("."):
            try:
                entries.append((entry.stat().st_mtime_ns, bytes.fromhex(name[: -len(FILE_SUFFIX)])))
            except (OSError, ValueError):
                continue  # vanished meanwhile, or not one of ours
    return [key for _, key in sorted(entries)]


def _one_block_like(cache: LayerKVCache) -> LayerKVCache:
    """A one-block cache of `cache`'s format (dtype, scales, layout)."""

    def one(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else torch.zeros_like(t[:1])

    return replace(cache, key=one(cache.key), value=one(cache.value),
                   key_scale=one(cache.key_scale), value_scale=one(cache.value_scale))  # fmt: skip


class DiskBlocks:
    """Writes, reads and deletes one server's block files; a writer thread does the I/O."""

    def __init__(self, directory: Path, host_caches: list[LayerKVCache], rank: int = 0) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.rank = rank
        self.caches = list({id(c): c for c in host_caches}.values())  # each distinct once
        # One block of the host tier's format per distinct cache, in the same per-layer order
        # as the device caches (apply_host_transfers pairs them layer by layer).
        scratch = {id(c): _one_block_like(c) for c in self.caches}
        self._scratch = [scratch[id(c)] for c in host_caches]
        self._scratch_distinct = [scratch[id(c)] for c in self.caches]
        self._pending: dict[bytes, dict[str, torch.Tensor]] = {}
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[bytes, dict[str, torch.Tensor] | None] | None] = (
            queue.Queue()
        )  # (key, tensors to write, or None: delete)
        self._thread = threading.Thread(target=self._loop, name="kv-disk-writer", daemon=True)
        self._thread.start()
        self.num_errors = 0
        self._reads: queue.Queue[tuple[bytes, int] | None] = queue.Queue()  # (key, slot)
        self._reading_slots: set[int] = set()
        self._finished: tuple[list[bytes], list[bytes]] = ([], [])  # (done, failed)
        self._read_ended = threading.Condition(self._lock)
        self.num_failed_reads = 0
        self._reader = threading.Thread(target=self._read_loop, name="kv-disk-reader",
                                        daemon=True)  # fmt: skip
        self._reader.start()

    def write(self, slots_and_keys: list[tuple[int, bytes]]) -> None:
        """Copy these host slots' rows now (the slots are reused in this step) and queue
        their files."""
        for slot, key in slots_and_keys:
            self._queue_write(key, self._snapshot(self.caches, slot))

    @staticmethod
    def _snapshot(caches: list[LayerKVCache], slot: int) -> dict[str, torch.Tensor]:
        return {
            f"{i}.{j}": table[slot].clone()
            for i, cache in enumerate(caches)
            for j, table in enumerate(cache.tensors)
        }

    def _queue_write(self, key: bytes, tensors: dict[str, torch.Tensor]) -> None:
        with self._lock:
            self._pending[key] = tensors
        self._queue.put((key, tensors))

    def write_from_device(
        self, device_caches: list[LayerKVCache], blocks_and_keys: list[tuple[int, bytes]]
    ) -> None:
        """Queue the files of these device blocks, in the host tier's format (through a
        one-block scratch slot of it): entries the host dropped in the step that offloaded
        them, before their slot held them."""
        for block_id, key in blocks_and_keys:
            pairs = [(block_id, 0)]
            apply_host_transfers(device_caches, self._scratch, to_host=pairs, from_host=[])
            self._queue_write(key, self._snapshot(self._scratch_distinct, 0))

    def start_reads(self, keys_and_slots: list[tuple[bytes, int]]) -> None:
        """Queue the reads of these blocks into their (reserved) host slots."""
        with self._lock:
            self._reading_slots.update(slot for _, slot in keys_and_slots)
        for item in keys_and_slots:
            self._reads.put(item)

    def take_finished_reads(self, wait_s: float = 0.0) -> tuple[list[bytes], list[bytes]]:
        """The keys whose reads ended since the last call: (done, failed).  With `wait_s`,
        waits up to that long for one to end when none has and some are under way (a step
        with nothing else to run does not spin)."""
        with self._lock:
            if wait_s and self._reading_slots and not any(self._finished):
                self._read_ended.wait(wait_s)
            finished, self._finished = self._finished, ([], [])
        return finished

    def wait_for_slots(self, slots: list[int]) -> None:
        """Block until no read fills one of these host slots (a load is about to copy them:
        with several ranks, rank 0's report does not say this rank's reads are done)."""
        wanted = set(slots)
        with self._lock:
            while self._reading_slots & wanted:
                self._read_ended.wait()

    def read(self, keys_and_slots: list[tuple[bytes, int]]) -> None:
        """Fill these host slots from their blocks' files (or the queue, not written yet),
        now (tests)."""
        for key, slot in keys_and_slots:
            self._read_into(key, slot)

    def _read_into(self, key: bytes, slot: int) -> None:
        with self._lock:
            tensors = self._pending.get(key)
        if tensors is None:
            tensors = load_file(block_file(self.directory, key, self.rank))
        for i, cache in enumerate(self.caches):
            for j, table in enumerate(cache.tensors):
                table[slot].copy_(tensors[f"{i}.{j}"])

    @torch.inference_mode()  # a rank > 0 allocates its host caches in inference mode
    def _read_loop(self) -> None:
        while (item := self._reads.get()) is not None:
            key, slot = item
            ok = True
            try:
                self._read_into(key, slot)
            except Exception as exc:  # noqa: BLE001 - gone (another server) or corrupt: a miss
                ok = False
                self._log_failed_read(key, exc)
            with self._lock:
                self._reading_slots.discard(slot)
                self._finished[0 if ok else 1].append(key)
                self._read_ended.notify_all()

    def _log_failed_read(self, key: bytes, exc: Exception) -> None:
        """Warn at the first failed read, then only count (a shared folder loses files)."""
        self.num_failed_reads += 1
        log = logger.warning if self.num_failed_reads == 1 else logger.debug
        log("KV disk tier: block %s could not be read (%s: %s): a miss, recomputed; "
            "later failures are only counted", key.hex(), type(exc).__name__, exc)  # fmt: skip

    def delete(self, keys: list[bytes]) -> None:
        for key in keys:
            self._queue.put((key, None))

    def flush(self) -> None:
        """Wait until every queued write and deletion is done (tests, shutdown)."""
        self._queue.join()

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._reads.put(None)
        self._thread.join()
        self._reader.join()

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            key, tensors = item
            try:
                if tensors is not None:
                    self._write(key, tensors)
                else:
                    block_file(self.directory, key, self.rank).unlink(missing_ok=True)
            except Exception as exc:  # noqa: BLE001 - a full or failing disk loses the block
                self.num_errors += 1
                logger.warning("KV disk tier: block %s: %s failed: %s", key.hex(),
                               "write" if tensors is not None else "delete", exc)  # fmt: skip
            finally:
                if tensors is not None:
                    with self._lock:
                        if self._pending.get(key) is tensors:
                            del self._pending[key]
                self._queue.task_done()
        self._queue.task_done()

    def _write(self, key: bytes, tensors: dict[str, torch.Tensor]) -> None:
        path = block_file(self.directory, key, self.rank)
        temporary = path.with_name(f".tmp-{os.getpid()}-{path.name}")
        save_file(tensors, str(temporary))
        os.replace(temporary, path)
