"""The prefix cache on disk (--prefix-cache-dir): full cached blocks survive a restart.

    DIR/<fingerprint digest>/fingerprint.json          what the blocks were computed with
    DIR/<fingerprint digest>/group-0000000007.safetensors
        <layer>.key / <layer>.value [n, block_size, kv_heads, head_dim] (storage dtype)
        <layer>.key_scale / <layer>.value_scale [n, block_size, kv_heads] (scaled 8-bit only)
        keys, parents [n, 32] uint8 (block key, parent key or zeros)
        contents [n] int64 (the statistics-only content hash, kv/prefix_cache.py)
        token_ids [n, block_size] int64

When: blocks cached since the last save are written every PREFIX_CACHE_SAVE_INTERVAL_S
seconds while the engine steps (their K/V copied on the engine thread, the file written by a
thread of its own), and all remaining ones at a clean shutdown (SIGTERM included); a crash
loses at most one interval.  Each group is written to a temporary name and renamed, so a
reader never sees half a file.  Over the size budget, the oldest groups (of any fingerprint)
are deleted first, as memory evicts its least recently used blocks.

At start-up, the groups of the directory whose fingerprint matches this engine are loaded,
newest first while free blocks last, as cold cached blocks: free, hashed, at the end of the
LRU queue that eviction takes from.  A store with another fingerprint is logged with the
reason and left alone; when only the KV dtype differs, its content hashes tell the miss
classifier that those tokens are `isolated`.  A file that does not read back (corrupt,
truncated, wrong shapes) is logged and deleted; it never stops the server.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvserve.attention.kv_cache import LayerKVCache
from kvserve.kv.cache_log import NewBlock
from kvserve.kv.cache_manager import KVCacheManager

logger = logging.getLogger("kvserve")

STORE_FORMAT = "kvserve-prefix-store-1"  # bump when block keys or the file layout change
MAX_GROUP_BLOCKS = 1024
_HASH_BYTES = 32


def fingerprint(
    model_path: Path,
    compute_dtype: str,
    kv_dtype: str,
    block_size: int,
    model_shape: str,
    tokenizer: object,
) -> dict[str, str]:
    """What the stored K/V depend on: the model files (name, size, mtime), the dtypes, the
    block size, the model's shape and the tokenizer's vocabulary and rules."""
    files = [model_path] if model_path.is_file() else sorted(model_path.glob("*"))
    stamps = [f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files if p.is_file()]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab()))
    return {
        "format": STORE_FORMAT,
        "model": model_path.name,
        "model_files": hashlib.sha256("\n".join(stamps).encode()).hexdigest()[:16],
        "compute_dtype": compute_dtype,
        "kv_cache_dtype": kv_dtype,
        "block_size": str(block_size),
        "model_shape": model_shape,
        "tokenizer": hashlib.sha256(text.encode()).hexdigest()[:16],
    }


def _digest(print_: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(print_, sort_keys=True).encode()).hexdigest()[:16]


def differences(stored: dict[str, str], current: dict[str, str]) -> list[str]:
    """'kv_cache_dtype: stored float32, now int8' for each field that differs."""
    names = sorted(set(stored) | set(current))
    return [
        f"{n}: stored {stored.get(n)}, now {current.get(n)}"
        for n in names
        if stored.get(n) != current.get(n)
    ]


@dataclass
class _Group:
    path: Path
    keys: list[bytes]
    num_bytes: int


class PrefixStore:
    """Reads and writes one engine's cached blocks; every method runs on the engine thread."""

    def __init__(
        self,
        directory: Path,
        print_: dict[str, str],
        max_bytes: int,
        kv_caches: list[LayerKVCache],
    ) -> None:
        self.root = directory
        self.fingerprint = print_
        self.directory = directory / _digest(print_)
        self.max_bytes = max_bytes
        self.kv_caches = kv_caches
        self._groups: dict[Path, _Group] = {}  # ours, oldest first
        self._on_disk: set[bytes] = set()
        self._pending: list[NewBlock] = []
        self._next_seq = 0
        self._last_save = time.monotonic()
        self._writes: queue.Queue[tuple[Path, dict[str, torch.Tensor]] | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="kvserve-store", daemon=True)
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / "fingerprint.json").write_text(json.dumps(print_, indent=1))
        self._writer.start()

    # ------------------------------------------------------------------ start-up
    def load(self, cache_manager: KVCacheManager) -> int:
        """Load the matching groups as cold cached blocks; returns the number of blocks."""
        self._report_other_stores(cache_manager)
        for stale in self.directory.glob(".tmp-*"):
            stale.unlink(missing_ok=True)
        paths = sorted(self.directory.glob("group-*.safetensors"))
        self._next_seq = 1 + max((int(p.stem.split("-")[1]) for p in paths), default=-1)
        room, chosen = cache_manager.pool.num_free_blocks, []  # at start-up: all uncached
        for path in reversed(paths):  # newest first while blocks last
            group = self._read_keys(path)
            if group is not None and room > 0:
                chosen.append(group)
                room -= len(group.keys)
            if group is not None:
                self._add_group(group)
        num_loaded = sum(self._load_group(g, cache_manager) for g in reversed(chosen))
        logger.info(
            "prefix cache store %s: loaded %d cached blocks from %d of %d groups",
            self.directory, num_loaded, len(chosen), len(paths),
        )  # fmt: skip
        return num_loaded

    def _report_other_stores(self, cache_manager: KVCacheManager) -> None:
        for other in sorted(self.root.glob("*/fingerprint.json")):
            if other.parent == self.directory:
                continue
            try:
                stored = json.loads(other.read_text())
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
                keys = _rows(f.get_tensor("keys"))
            return _Group(path, keys, path.stat().st_size)
        except Exception as exc:  # noqa: BLE001 - a broken file never stops the server
            self._drop_broken(path, exc)
            return None

    def _load_group(self, group: _Group, cache_manager: KVCacheManager) -> int:
        try:
            with safe_open(str(group.path), framework="pt") as f:
                tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
            self._check_shapes(tensors, len(group.keys))
        except Exception as exc:  # noqa: BLE001
            self._drop_broken(group.path, exc)
            return 0
        block_ids = cache_manager.load_cold_blocks(group.keys, tensors["contents"].tolist())
        rows = [i for i, b in enumerate(block_ids) if b >= 0]
        if not rows:
            return 0
        device = self.kv_caches[0].key.device
        src = torch.tensor(rows)
        dst = torch.tensor([block_ids[i] for i in rows], device=device)
        for layer, cache in enumerate(self.kv_caches):
            for name, table in _tables(cache):
                table[dst] = tensors[f"{layer}.{name}"][src].to(device)
        return len(rows)

    def _check_shapes(self, tensors: dict[str, torch.Tensor], num_blocks: int) -> None:
        for layer, cache in enumerate(self.kv_caches):
            for name, table in _tables(cache):
                stored = tensors[f"{layer}.{name}"]
                if stored.dtype != table.dtype or stored.shape[1:] != table.shape[1:]:
                    raise ValueError(f"{layer}.{name} is {stored.dtype} {list(stored.shape)}")
                if stored.shape[0] != num_blocks:
                    raise ValueError(f"{layer}.{name} holds {stored.shape[0]} blocks")

    def _drop_broken(self, path: Path, exc: Exception) -> None:
        logger.warning("prefix cache store: deleting %s, which does not read back (%s: %s)",
                       path, type(exc).__name__, exc)  # fmt: skip
        self._groups.pop(path, None)
        path.unlink(missing_ok=True)

    # ------------------------------------------------------------------ saving
    def maybe_save(self, cache_manager: KVCacheManager, interval: float) -> None:
        """Save the blocks cached since the last save once `interval` seconds have passed."""
        if time.monotonic() - self._last_save >= interval:
            self.save(cache_manager)

    def save(self, cache_manager: KVCacheManager) -> int:
        """Copy the K/V of newly cached blocks and queue them for writing; returns how many."""
        self._last_save = time.monotonic()
        self._pending.extend(cache_manager.take_new_blocks())
        blocks = cache_manager.pool.blocks
        todo = [
            b for b in self._pending
            if b.key not in self._on_disk and blocks[b.block_id].block_hash == b.key
        ]  # fmt: skip
        self._pending = []
        for start in range(0, len(todo), MAX_GROUP_BLOCKS):
            group = todo[start : start + MAX_GROUP_BLOCKS]
            path = self.directory / f"group-{self._next_seq:010d}.safetensors"
            self._next_seq += 1
            self._writes.put((path, self._tensors(group)))
            self._add_group(_Group(path, [b.key for b in group], 0))
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
        self._on_disk.update(group.keys)

    def _write_loop(self) -> None:
        while (item := self._writes.get()) is not None:
            path, tensors = item
            temporary = path.with_name(f".tmp-{path.name}")
            try:
                save_file(tensors, str(temporary), metadata={"fingerprint": json.dumps(
                    self.fingerprint)})  # fmt: skip
                os.replace(temporary, path)
                self._enforce_budget()
            except OSError as exc:
                logger.warning("prefix cache store: could not write %s (%s)", path, exc)
                temporary.unlink(missing_ok=True)
            finally:
                self._writes.task_done()

    def _enforce_budget(self) -> None:
        """Delete the oldest groups (any fingerprint) while the directory exceeds the budget
        (writer thread; `_on_disk` may keep a deleted group's keys until the next start)."""
        files = sorted(self.root.glob("*/group-*.safetensors"), key=lambda p: p.stat().st_mtime)
        total = sum(p.stat().st_size for p in files)
        for path in files:
            if total <= self.max_bytes:
                return
            total -= path.stat().st_size
            path.unlink(missing_ok=True)

    def clear(self) -> None:
        """Delete this engine's groups (a prefix cache reset), after the writes under way."""
        self._writes.join()
        for path in list(self._groups):
            path.unlink(missing_ok=True)
        self._groups.clear()
        self._on_disk.clear()
        self._pending.clear()

    def close(self, cache_manager: KVCacheManager) -> None:
        """Write every block not yet on disk and wait for the writer (a clean shutdown)."""
        num = self.save(cache_manager)
        self._writes.put(None)
        self._writer.join()
        logger.info("prefix cache store %s: %d new blocks written at shutdown", self.directory, num)


def _tables(cache: LayerKVCache) -> list[tuple[str, torch.Tensor]]:
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
