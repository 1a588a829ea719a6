"""The index that KV events describe: which blocks each tier holds, with their parents and
tokens (pure Python).  The cache log (kv/cache_log.py) updates it as it logs each event, on the
engine thread; the event publisher's thread reads a snapshot of it (a subscriber that starts
late or lost batches rebuilds its index from that snapshot, then follows the events).

A snapshot is the events that rebuild the index from nothing:

    AllBlocksCleared, then per medium BlockStored runs, a parent held in the same medium
    before its children (a block whose parent that medium does not hold names the parent
    all the same, as its live event did)

It is consistent with any sequence number drawn before it was copied: replaying every batch
from there over it ends in the same index, because each event's effect on a block does not
depend on the state it finds (a store adds, a removal drops, a clear empties).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from kvserve.kv.events import AllBlocksCleared, BlockStored, KVEvent


@dataclass(frozen=True)
class IndexEntry:
    parent: bytes | None
    token_ids: tuple[int, ...]
    salted: bool


UNKNOWN = IndexEntry(None, (), False)  # a block that no event announced yet


class Lock(Protocol):
    def __enter__(self) -> Any: ...
    def __exit__(self, *exc: object) -> Any: ...


class NoLock:
    """One thread only (kv/ takes no thread's lock: the owner of threads passes one in)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


class CacheIndex:
    """medium -> block key -> IndexEntry, in the order the blocks were stored.  Every method
    holds `lock`: the engine passes a threading.Lock, since the publisher thread copies what
    the engine thread changes."""

    def __init__(self, block_size: int, lock: Lock | None = None) -> None:
        self.block_size = block_size
        self._lock = lock if lock is not None else NoLock()
        self._media: dict[str, dict[bytes, IndexEntry]] = {}

    def store(self, medium: str, key: bytes, entry: IndexEntry) -> None:
        with self._lock:
            self._media.setdefault(medium, {})[key] = entry

    def remove(self, medium: str, keys: list[bytes]) -> None:
        with self._lock:
            held = self._media.get(medium, {})
            for key in keys:
                held.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._media.clear()

    def entry(self, medium: str, key: bytes) -> IndexEntry | None:
        with self._lock:
            return self._media.get(medium, {}).get(key)

    def keys(self, medium: str) -> set[bytes]:
        """The blocks `medium` holds."""
        with self._lock:
            return set(self._media.get(medium, ()))

    def copy(self) -> dict[str, dict[bytes, IndexEntry]]:
        """The whole index now (the lock is held only while copying)."""
        with self._lock:
            return {medium: dict(held) for medium, held in self._media.items() if held}

    def snapshot(self) -> list[KVEvent]:
        """The events that rebuild the index: AllBlocksCleared, then every medium's blocks."""
        events: list[KVEvent] = [AllBlocksCleared()]
        for medium, held in self.copy().items():
            events.extend(chain_runs(medium, held, self.block_size))
        return events


def append_stored(
    events: list[Any], medium: str, key: bytes, entry: IndexEntry, block_size: int
) -> None:
    """One block stored in `medium`, onto `events`: onto the last event when it is a
    BlockStored run of the same medium that the block continues (its parent is the run's last
    block, alike in saltedness and in having its tokens), else as a run of its own."""
    last = events[-1] if events else None
    if (
        isinstance(last, BlockStored)
        and last.medium == medium
        and last.block_hashes[-1] == entry.parent
        and last.salted == entry.salted
        and bool(last.token_ids) == bool(entry.token_ids)
    ):
        last.block_hashes.append(key)
        last.token_ids.extend(entry.token_ids)
    else:
        events.append(BlockStored([key], entry.parent, list(entry.token_ids), block_size,
                                  entry.salted, medium))  # fmt: skip


def chain_runs(medium: str, held: dict[bytes, IndexEntry], block_size: int) -> list[BlockStored]:
    """`held` as BlockStored runs, depth first from each block whose parent `held` lacks: a
    run follows a chain while the next block is alike in saltedness and in having its tokens
    (the first child goes on the run, the others start runs of their own)."""
    children: dict[bytes, list[bytes]] = {}
    roots = []
    for key, entry in held.items():
        if entry.parent in held and entry.parent != key:
            children.setdefault(entry.parent, []).append(key)
        else:
            roots.append(key)
    runs: list[BlockStored] = []
    stack = list(reversed(roots))
    while stack:
        key = stack.pop()
        entry = held[key]
        append_stored(runs, medium, key, entry, block_size)
        stack.extend(reversed(children.get(key, ())))
    return runs
