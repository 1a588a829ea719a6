"""The prefix cache on disk (--prefix-cache-dir): full cached blocks survive a restart.

    DIR/kvserve.lock                                   held (flock) by the one server writing DIR
    DIR/<fingerprint digest>/fingerprint.json          what the blocks were computed with
    DIR/<fingerprint digest>/group-0000000007.safetensors
        <layer>.key / <layer>.value [n, block_size, kv_heads, head_dim] (storage dtype)
        <layer>.key_scale / <layer>.value_scale [n, block_size, kv_heads] (scaled 8-bit only)
        keys, parents [n, 32] uint8 (block key, parent key or zeros)
        contents [n] int64 (the statistics-only content hash, kv/block_hasher.py)
        token_ids [n, block_size] int64
        metadata "fingerprint": the JSON of the fingerprint, checked before a block is used

When: blocks cached since the last save are written every PREFIX_CACHE_SAVE_INTERVAL_S
seconds while the engine steps (their K/V copied on the engine thread, the file written by a
thread of its own), and all remaining ones at a clean shutdown (SIGTERM included); a crash
loses at most one interval.  Each group is written to a temporary name and renamed, so a
reader never sees half a file.  Over the size budget, the oldest groups (of any fingerprint)
are deleted first, as memory evicts its least recently used blocks.

The store is a tier below the KV cache, read lazily.  At start-up the groups of the directory
whose fingerprint matches this engine are indexed (their keys and content hashes, not their
K/V); the groups this server writes join the index.  Before each step, the blocks that would
extend the cached prefix of a request at the head of the waiting queue, and that no tier
holds but the store, are read back (`fetch`, on the engine thread: consecutive rows of a
group in one read) into device blocks, cached and free, which that step's lookup finds.  A
block evicted from memory since it was saved comes back the same way.  A store with another
fingerprint is logged with the reason and left alone; when only the KV dtype differs, its
content hashes tell the miss classifier that those tokens are `isolated`.

The store fails safe (StoreState): serving never depends on it.
- One server writes a directory: the first takes DIR/kvserve.lock; another one (a second
  replica with the same flags) logs the holder's pid and is READ_ONLY: it reads the blocks
  and never writes or deletes a file.
- Any error of the writer or of the copies for it (disk full, directory deleted or read-only,
  any exception type) turns the store OFF: one error line naming the directory,
  `num_errors` (kvserve:prefix_store_errors_total), and nothing touches the disk again.
- At most `max_pending_bytes` of K/V copies wait for the writer (one group more when none
  does); blocks over that wait as ids for the next save.  A reset never waits for the writer.
- Nothing in the directory stops the start-up: an unknown name, a directory named like a
  group, another fingerprint (stored in the file or in fingerprint.json) is skipped with a
  warning and kept; a group that does not read back is deleted only when it is this server's
  own (its name in its own fingerprint's directory, the lock held).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open

from kvserve.engine.store_writer import (
    GROUP_NAME,
    GroupDeletion,
    GroupWrite,
    StoreState,
    StoreWriter,
    try_lock,
)
from kvserve.kv.cache_log import NewBlock
from kvserve.kv.cache_manager import HashedRequest, KVCacheManager

logger = logging.getLogger("kvserve")

STORE_FORMAT = "kvserve-prefix-store-1"  # bump when block keys or the file layout change
MAX_GROUP_BLOCKS = 1024
MAX_FETCH_BYTES = 256 * 2**20  # K/V read back for one waiting request before a step, at most
MAX_PENDING_BYTES = 512 * 2**20  # K/V copies waiting for the writer, at most (+ one group)
WRITER_STALL_S = 30.0  # at shutdown: give up on a writer that finishes nothing for this long
LOCK_NAME = "kvserve.lock"
_HASH_BYTES = 32
_TEMPORARY_NAME = re.compile(r"\.tmp-(group-\d{10}\.safetensors|fingerprint\.json)")


def fingerprint(
    model_path: Path,
    compute_dtype: str,
    kv_dtype: str,
    block_size: int,
    model_shape: str,
    tokenizer: object,
    rotated_rows: str | None = None,
) -> dict[str, str]:
    """What the stored K/V depend on: the model files (name, size, mtime), the dtypes, the
    block size, the model's shape and the tokenizer's vocabulary and rules; for a cache of
    rotated rows, what they hold (`rotated_rows`, kv_quant.ROTATED_ROWS_VERSION)."""
    files = [model_path] if model_path.is_file() else sorted(model_path.glob("*"))
    stamps = [f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files if p.is_file()]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab()))
    rotated = {"rotated_rows": rotated_rows} if rotated_rows is not None else {}
    return {
        **rotated,
        "format": STORE_FORMAT,
        "model": model_path.name,
        "model_files": hashlib.sha256("\n".join(stamps).encode()).hexdigest()[:16],
        "compute_dtype": compute_dtype,
        "kv_cache_dtype": kv_dtype,
        "block_size": str(block_size),
        "model_shape": model_shape,
        "tokenizer": hashlib.sha256(text.encode()).hexdigest()[:16],
    }


def digest(print_: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(print_, sort_keys=True).encode()).hexdigest()[:16]


def differences(stored: dict[str, str], current: dict[str, str]) -> list[str]:
    """'kv_cache_dtype: stored float32, now int8' for each field that differs."""
    names = sorted(set(stored) | set(current))
    return [
        f"{n}: stored {stored.get(n)}, now {current.get(n)}"
        for n in names
        if stored.get(n) != current.get(n)
    ]


class LayerKVTensors(Protocol):
    """What the store reads and writes of one layer's KV cache (attention/kv_cache.py's
    LayerKVCache, as the executor hands it over): the tables indexed by block id."""

    key: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim]
    value: torch.Tensor
    key_scale: torch.Tensor | None  # [num_blocks, block_size, kv_heads], scaled 8-bit only
    value_scale: torch.Tensor | None


@dataclass
class _Group:
    path: Path
    keys: list[bytes]
    num_bytes: int
    contents: list[int]  # the statistics-only content hash of each block


class PrefixStore:
    """Reads one engine's cached blocks at start-up and hands new ones to its writer
    (engine/store_writer.py); every method runs on the engine thread."""

    def __init__(
        self,
        directory: Path,
        print_: dict[str, str],
        max_bytes: int,
        kv_caches: list[LayerKVTensors],
        max_pending_bytes: int = MAX_PENDING_BYTES,
    ) -> None:
        """Takes the directory's lock; never raises (a directory it cannot use turns the
        store OFF, another server holding it makes it READ_ONLY)."""
        self.root = directory
        self.fingerprint = print_
        self.directory = directory / digest(print_)
        self.kv_caches = kv_caches
        self.writer = StoreWriter(directory, self.directory, print_, max_bytes, max_pending_bytes)
        self.holder: str | None = None  # READ_ONLY: the pid that holds the lock
        self._block_bytes = _bytes_per_block(kv_caches)
        self._groups: dict[Path, _Group] = {}  # ours, oldest first
        # Every stored block, by key: (its group file, its row there, its content hash).
        self._index: dict[bytes, tuple[Path, int, int]] = {}
        self._pending: dict[bytes, NewBlock] = {}  # no room for their copies yet
        self._next_seq = 0
        self._last_save = time.monotonic()
        self._lock_fd: int | None = None
        self._open()
        if self.state is StoreState.WRITING:
            self.writer.start()

    @property
    def state(self) -> StoreState:
        return self.writer.state

    @property
    def num_errors(self) -> int:
        """Errors that turned the store off since start."""
        return self.writer.num_errors

    def _open(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._lock_fd, self.holder = try_lock(self.root / LOCK_NAME)
            if self._lock_fd is None:
                self.writer.state = StoreState.READ_ONLY
                logger.warning(
                    "prefix cache store %s is held by another server (pid %s): this one loads "
                    "it at start-up and writes nothing", self.root, self.holder,
                )  # fmt: skip
                return
            self.directory.mkdir(exist_ok=True)
            temporary = self.directory / ".tmp-fingerprint.json"
            temporary.write_text(json.dumps(self.fingerprint, indent=1))
            os.replace(temporary, self.directory / "fingerprint.json")
        except Exception as exc:  # noqa: BLE001 - the server starts without the store
            self.writer.fail(exc, "opening the directory")

    # ------------------------------------------------------------------ start-up
    def index(self, cache_manager: KVCacheManager) -> int:
        """List the matching groups' blocks (their keys and content hashes, not their K/V:
        `fetch` reads a block when a request needs it); returns how many.  Never raises:
        an unexpected error turns the store off."""
        if self.state is StoreState.OFF:
            return 0
        try:
            self._report_other_stores(cache_manager)
            paths = self._scan()
            groups = [g for g in map(self._read_keys, paths) if g is not None]
            for group in groups:
                self._add_group(group)
        except Exception as exc:  # noqa: BLE001
            self._index.clear()
            self.writer.fail(exc, "indexing")
            return 0
        logger.info(
            "prefix cache store %s: %d cached blocks from %d of %d groups indexed, read when "
            "a request needs them", self.directory, len(self._index), len(groups), len(paths),
        )  # fmt: skip
        return len(self._index)

    # ------------------------------------------------------------------ serving
    def fetch(
        self,
        requests: list[HashedRequest],
        cache_manager: KVCacheManager,
        run_tier_copies: Callable[[], object],
    ) -> int:
        """Before a step: read back the stored blocks that would extend these waiting
        requests' cached prefixes (what no tier holds), into device blocks cached and free
        (the lookup of the step about to be scheduled finds them).  On the engine thread, at
        most MAX_FETCH_BYTES a request; a block that does not read back (gone with the size
        budget or a reset of another server, corrupt) is a miss: it and the blocks after it
        are computed.  `run_tier_copies` runs the copies that the blocks' evictions queued
        (a host tier's offloads), before the reads overwrite those blocks.  Returns the
        number of blocks read."""
        if not self._index or self.state is StoreState.OFF:
            return 0
        num_read = 0
        for request in requests:
            found = cache_manager.stored_prefix_keys(request, self._index)
            found = found[: max(1, MAX_FETCH_BYTES // max(1, self._block_bytes))]
            contents = [self._index[key][2] for _, key in found]
            tensors, num_rows = self._read_rows([key for _, key in found])
            block_ids = cache_manager.cache_stored_blocks(
                request, found[:num_rows], contents[:num_rows]
            )
            if not block_ids:
                continue
            if cache_manager.host is not None:
                run_tier_copies()
            self._copy_in(tensors, block_ids)
            num_read += len(block_ids)
        return num_read

    def _read_rows(self, keys: list[bytes]) -> tuple[dict[str, torch.Tensor], int]:
        """The stored tables of `keys`, in order, up to the first that does not read back:
        (name -> [n, ...] tensor, n)."""
        parts: dict[str, list[torch.Tensor]] = {}
        num_rows = 0
        for path, rows in _runs((self._index[key][0], self._index[key][1]) for key in keys):
            try:
                read = self._read_run(path, rows, keys[num_rows : num_rows + len(rows)])
            except Exception as exc:  # noqa: BLE001 - a miss, never a failed step
                self._forget(path, exc)
                break
            for name, tensor in read.items():
                parts.setdefault(name, []).append(tensor)
            num_rows += len(rows)
        return {name: torch.cat(ts) for name, ts in parts.items()}, num_rows

    def _read_run(self, path: Path, rows: range, keys: list[bytes]) -> dict[str, torch.Tensor]:
        """Rows `rows` (consecutive) of a group file: every layer's tables, checked against
        the keys they must hold."""
        with safe_open(str(path), framework="pt") as f:
            if self._foreign(path, f.metadata()):
                raise ValueError("its fingerprint changed")
            if _rows(f.get_slice("keys")[rows.start : rows.stop]) != keys:
                raise ValueError("its keys changed since they were indexed")
            tensors = {
                f"{layer}.{name}": f.get_slice(f"{layer}.{name}")[rows.start : rows.stop]
                for layer, cache in enumerate(self.kv_caches)
                for name, _ in _tables(cache)
            }
        self._check_shapes(tensors, len(rows))
        return tensors

    def _forget(self, path: Path, exc: Exception) -> None:
        """A group that did not read back: its blocks leave the index (a missing file is
        only forgotten; a broken one is dropped as at start-up), unless it is still on its
        way to the disk (this server's writer has not written it yet: a miss this time)."""
        if self.writer.is_queued(path):
            return
        if isinstance(exc, FileNotFoundError):
            self._remove_group(path)
        else:
            self._drop_broken(path, exc)

    def _copy_in(self, tensors: dict[str, torch.Tensor], block_ids: list[int]) -> None:
        device = self.kv_caches[0].key.device
        dst = torch.tensor(block_ids, device=device)
        n = len(block_ids)
        for layer, cache in enumerate(self.kv_caches):
            for name, table in _tables(cache):
                table[dst] = tensors[f"{layer}.{name}"][:n].to(device)

    def _scan(self) -> list[Path]:
        """This fingerprint's group files, oldest first.  Anything else is left alone with a
        warning, but for the temporary files of a write cut short while this server's
        configuration held the lock (deleted when it holds it now)."""
        if not self.directory.is_dir():
            return []
        groups = []
        for entry in sorted(self.directory.iterdir()):
            group = GROUP_NAME.fullmatch(entry.name)
            if group is not None:  # never reused, even when it is not ours
                self._next_seq = max(self._next_seq, int(group[1]) + 1)
            if entry.is_file() and group is not None:
                groups.append(entry)
            elif entry.is_file() and entry.name == "fingerprint.json":
                continue
            elif entry.is_file() and _TEMPORARY_NAME.fullmatch(entry.name):
                if self.state is StoreState.WRITING:
                    entry.unlink(missing_ok=True)
            else:
                logger.warning("prefix cache store: skipping %s (not a group file)", entry)
        return groups

    def _report_other_stores(self, cache_manager: KVCacheManager) -> None:
        for other in sorted(self.root.glob("*/fingerprint.json")):
            if other.parent == self.directory:
                continue
            try:
                stored = json.loads(other.read_text())
                if not isinstance(stored, dict):
                    raise ValueError(f"it holds a JSON {type(stored).__name__}")
            except (OSError, ValueError) as exc:
                logger.warning("prefix cache store %s: unreadable fingerprint (%s)", other, exc)
                continue
            reasons = differences(stored, self.fingerprint)
            logger.warning(
                "prefix cache store %s not loaded: its fingerprint differs (%s)",
                other.parent, "; ".join(reasons),
            )  # fmt: skip
            if [r.split(":")[0] for r in reasons] == ["kv_cache_dtype"]:
                self._note_isolated(other.parent, cache_manager)

    def _note_isolated(self, directory: Path, cache_manager: KVCacheManager) -> None:
        """The same tokens stored under another KV dtype: their misses are `isolated`."""
        for path in sorted(directory.glob("group-*.safetensors")):
            try:
                with safe_open(str(path), framework="pt") as f:
                    keys, contents = f.get_tensor("keys"), f.get_tensor("contents")
                cache_manager.note_isolated(contents.tolist(), _rows(keys))
            except Exception:  # noqa: BLE001 - another store's file: best effort
                continue

    def _read_keys(self, path: Path) -> _Group | None:
        try:
            with safe_open(str(path), framework="pt") as f:
                foreign = self._foreign(path, f.metadata())
                keys = [] if foreign else _rows(f.get_tensor("keys"))
                contents = [] if foreign else f.get_tensor("contents").tolist()
                if len(contents) != len(keys):
                    raise ValueError(f"{len(keys)} keys, {len(contents)} contents")
            size = path.stat().st_size
        except Exception as exc:  # noqa: BLE001 - a broken file never stops the server
            self._drop_broken(path, exc)
            return None
        return None if foreign else _Group(path, keys, size, contents)

    def _foreign(self, path: Path, metadata: dict[str, str] | None) -> bool:
        """Whether the fingerprint stored in a file differs from this engine's (warned)."""
        try:
            stored = json.loads((metadata or {}).get("fingerprint", "{}"))
        except ValueError:
            stored = {}
        stored = stored if isinstance(stored, dict) else {}
        reasons = differences(stored, self.fingerprint)
        if reasons:
            logger.warning(
                "prefix cache store: %s not loaded, kept: the fingerprint it holds differs (%s)",
                path, "; ".join(reasons),
            )  # fmt: skip
        return bool(reasons)

    def _check_shapes(self, tensors: dict[str, torch.Tensor], num_blocks: int) -> None:
        for layer, cache in enumerate(self.kv_caches):
            for name, table in _tables(cache):
                stored = tensors[f"{layer}.{name}"]
                if stored.dtype != table.dtype or stored.shape[1:] != table.shape[1:]:
                    raise ValueError(f"{layer}.{name} is {stored.dtype} {list(stored.shape)}")
                if stored.shape[0] != num_blocks:
                    raise ValueError(f"{layer}.{name} holds {stored.shape[0]} blocks")

    def _drop_broken(self, path: Path, exc: Exception) -> None:
        """A group that does not read back: deleted when it is ours, else only skipped."""
        self._remove_group(path)
        ours = self.state is StoreState.WRITING and path.parent == self.directory
        logger.warning(
            "prefix cache store: %s %s, which does not read back (%s: %s)",
            "deleting" if ours else "skipping", path, type(exc).__name__, exc,
        )  # fmt: skip
        if ours:
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)

    # ------------------------------------------------------------------ saving
    def maybe_save(self, cache_manager: KVCacheManager, interval: float) -> None:
        """Save the blocks cached since the last save once `interval` seconds have passed."""
        if time.monotonic() - self._last_save >= interval:
            self.save(cache_manager)

    def save(self, cache_manager: KVCacheManager, wait: float = 0.0) -> int:
        """Copy the K/V of newly cached blocks and queue them for writing; returns how many.
        Blocks over max_pending_bytes stay pending (ids only) for the next save; `wait`
        seconds (shutdown) are given to the writer to make room for each group.  Not
        WRITING: the new blocks are dropped (counted as not written)."""
        self._last_save = time.monotonic()
        new_blocks = cache_manager.take_new_blocks()  # taken always: the list never grows
        if self.state is not StoreState.WRITING:
            self.writer.count_not_written(len(new_blocks))
            return 0
        try:
            return self._queue_writes(new_blocks, cache_manager, wait)
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory for the copies
            self.writer.fail(exc, "copying blocks for the writer")
            return 0

    def _queue_writes(
        self, new_blocks: list[NewBlock], cache_manager: KVCacheManager, wait: float
    ) -> int:
        self._pending.update((b.key, b) for b in new_blocks)
        blocks = cache_manager.pool.blocks
        todo = [
            b for b in self._pending.values()
            if b.key not in self._index and blocks[b.block_id].block_hash == b.key
        ]  # fmt: skip
        self._pending = {}
        for start in range(0, len(todo), MAX_GROUP_BLOCKS):
            group = todo[start : start + MAX_GROUP_BLOCKS]
            num_bytes = len(group) * self._block_bytes
            if not self.writer.reserve(len(group), num_bytes, wait):
                self._pending = {b.key: b for b in todo[start:]}
                return start
            path = self.directory / f"group-{self._next_seq:010d}.safetensors"
            self._next_seq += 1
            self.writer.put(GroupWrite(path, self._tensors(group), len(group), num_bytes))
            self._add_group(_Group(path, [b.key for b in group], 0, [b.content for b in group]))
        return len(todo)

    def _tensors(self, group: list[NewBlock]) -> dict[str, torch.Tensor]:
        ids = torch.tensor([b.block_id for b in group], device=self.kv_caches[0].key.device)
        tensors = {
            f"{layer}.{name}": table.index_select(0, ids).cpu()
            for layer, cache in enumerate(self.kv_caches)
            for name, table in _tables(cache)
        }
        zeros = bytes(_HASH_BYTES)
        tensors["keys"] = _hash_tensor([b.key for b in group])
        tensors["contents"] = torch.tensor([b.content for b in group], dtype=torch.int64)
        tensors["parents"] = _hash_tensor([b.parent_key or zeros for b in group])
        tensors["token_ids"] = torch.tensor([b.token_ids for b in group], dtype=torch.int64)
        return tensors

    def _add_group(self, group: _Group) -> None:
        self._groups[group.path] = group
        for row, (key, content) in enumerate(zip(group.keys, group.contents, strict=True)):
            self._index[key] = (group.path, row, content)

    def _remove_group(self, path: Path) -> None:
        group = self._groups.pop(path, None)
        for key in group.keys if group is not None else ():
            if self._index.get(key, (None,))[0] == path:
                del self._index[key]

    # ------------------------------------------------------------------ reset, shutdown
    def clear(self) -> None:
        """Forget this engine's groups; the writer deletes their files after the write under
        way (queued writes are dropped).  Never waits for the writer: a reset answers at once
        whatever the writer is doing."""
        paths = list(self._groups)
        self._groups.clear()
        self._index.clear()
        self._pending.clear()
        if self.state is StoreState.WRITING:
            self.writer.drop_queued()
            self.writer.put(GroupDeletion(paths))
        elif paths:
            logger.warning("prefix cache store %s is %s: its files are kept",
                           self.root, self.state.value)  # fmt: skip

    def close(self, cache_manager: KVCacheManager) -> None:
        """Write every block not yet on disk, wait for the writer while it makes progress,
        release the lock and log what was and was not written (a clean shutdown)."""
        num_before = self.writer.counts().num_written
        self.save(cache_manager, wait=WRITER_STALL_S)
        finished = self.writer.stop(0.0 if self._pending else WRITER_STALL_S)
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the lock
            self._lock_fd = None
        counts = self.writer.counts()
        num_written = counts.num_written - num_before
        num_lost = counts.num_not_written + counts.num_queued + len(self._pending)
        if num_lost == 0:
            logger.info("prefix cache store %s: %d new blocks written at shutdown",
                        self.directory, num_written)  # fmt: skip
            return
        logger.warning(
            "prefix cache store %s: %d new blocks written at shutdown, %d cached blocks not "
            "written (%s)", self.directory, num_written, num_lost, self._why(finished),
        )  # fmt: skip

    def _why(self, finished: bool) -> str:
        if self.state is StoreState.READ_ONLY:
            return f"the directory is held by pid {self.holder}"
        if self.state is StoreState.OFF:
            return "the store was turned off by an error"
        if not finished:
            return f"the writer finished nothing for {WRITER_STALL_S:.0f} s"
        return f"no room for their copies within {WRITER_STALL_S:.0f} s"


def _bytes_per_block(kv_caches: list[LayerKVTensors]) -> int:
    """Bytes of one block's copies: its K/V (and scales) in every layer."""
    return sum(
        math.prod(table.shape[1:]) * table.element_size()
        for cache in kv_caches
        for _, table in _tables(cache)
    )


def _tables(cache: LayerKVTensors) -> list[tuple[str, torch.Tensor]]:
    tables = [("key", cache.key), ("value", cache.value)]
    if cache.key_scale is not None and cache.value_scale is not None:
        tables += [("key_scale", cache.key_scale), ("value_scale", cache.value_scale)]
    return tables


def _hash_tensor(hashes: list[bytes]) -> torch.Tensor:
    return torch.frombuffer(bytearray(b"".join(hashes)), dtype=torch.uint8).view(-1, _HASH_BYTES)


def _rows(table: torch.Tensor) -> list[bytes]:
    if table.dim() != 2 or table.shape[1] != _HASH_BYTES or table.dtype != torch.uint8:
        raise ValueError(f"hash table of shape {list(table.shape)}")
    data = table.contiguous().numpy().tobytes()
    return [data[i : i + _HASH_BYTES] for i in range(0, len(data), _HASH_BYTES)]


def _runs(locations: Iterable[tuple[Path, int]]) -> list[tuple[Path, range]]:
    """(file, row) locations in order -> runs of consecutive rows of one file (one read each)."""
    runs: list[tuple[Path, range]] = []
    for path, row in locations:
        if runs and runs[-1][0] == path and runs[-1][1].stop == row:
            runs[-1] = (path, range(runs[-1][1].start, row + 1))
        else:
            runs.append((path, range(row, row + 1)))
    return runs
