"""What the prefix cache did, kept for the world outside the engine step (pure Python): KV
events for subscribers (kv/events.py), with the index they describe (kv/event_index.py), and
the blocks cached since the last save, for the store on disk.  Each half is off (None, nothing
recorded) unless asked for.

Events name the tier (`medium`) of every store and removal.  A block that moves between tiers
is announced where it arrives before it is removed where it was, with the parent and tokens it
was announced with (the index keeps them): a subscriber never sees it held nowhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.kv.event_index import UNKNOWN, CacheIndex, IndexEntry, append_stored
from kvserve.kv.events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, KVEvent


@dataclass(frozen=True)
class NewBlock:
    """A block cached since the last `take_new_blocks`, with what it takes to store it."""

    block_id: int
    key: bytes
    content: int  # the statistics-only content hash (kv/block_hasher.py)
    parent_key: bytes | None
    token_ids: list[int]


class CacheLog:
    def __init__(
        self, block_size: int, enable_events: bool, track_new_blocks: bool,
        index: CacheIndex | None = None,
    ) -> None:  # fmt: skip
        """`index`: the one the events update (with events on; None: a new one)."""
        self.block_size = block_size
        self._events: list[KVEvent] | None = [] if enable_events else None
        self.index = (index or CacheIndex(block_size)) if enable_events else None
        self._new_blocks: list[NewBlock] | None = [] if track_new_blocks else None

    @property
    def active(self) -> bool:
        return self._events is not None or self._new_blocks is not None

    def stored(
        self,
        indices: list[int],
        keys: Sequence[bytes],
        contents: Sequence[int],
        token_ids: Sequence[int],
        table: list[int],
        num_unsalted: int,
    ) -> None:
        """Blocks `indices` of a request (its keys, contents, tokens, block table) were cached:
        one BlockStored per run of consecutive blocks alike in saltedness (blocks from
        `num_unsalted` on are keyed under the request's cache salt), and the blocks to persist."""
        size = self.block_size
        for i in indices:
            parent = keys[i - 1] if i else None
            tokens = list(token_ids[i * size : (i + 1) * size])
            if self._new_blocks is not None:
                self._new_blocks.append(NewBlock(table[i], keys[i], contents[i], parent, tokens))
            if self._events is not None:
                entry = IndexEntry(parent, tuple(tokens), i >= num_unsalted)
                self._log_store(MEDIUM_GPU, keys[i], entry)

    def _log_store(self, medium: str, key: bytes, entry: IndexEntry) -> None:
        """One block stored in `medium`: onto the last event when it continues its run."""
        assert self._events is not None and self.index is not None
        self.index.store(medium, key, entry)
        append_stored(self._events, medium, key, entry, self.block_size)

    def stored_in_group(
        self, indices: list[int], keys: Sequence[bytes], contents: Sequence[int],
        token_ids: Sequence[int], table: list[int],
    ) -> None:  # fmt: skip
        """Blocks `indices` of a KV cache group after the first were cached (`keys`: that
        group's, kv/groups.py group_key): the blocks to persist, no event (events describe
        group 0's blocks)."""
        if self._new_blocks is None:
            return
        size = self.block_size
        for i in indices:
            tokens = list(token_ids[i * size : (i + 1) * size])
            parent = keys[i - 1] if i else None
            self._new_blocks.append(NewBlock(table[i], keys[i], contents[i], parent, tokens))

    def evicted(self, key: bytes) -> None:
        """A cached block was evicted from the device to make room (consecutive evictions:
        one event)."""
        self.removed([key], MEDIUM_GPU)

    def removed(self, keys: list[bytes], medium: str) -> None:
        """`medium` no longer holds these blocks (onto the last event when it removes from
        the same medium)."""
        if self._events is None or not keys:
            return
        assert self.index is not None
        self.index.remove(medium, keys)
        last = self._events[-1] if self._events else None
        if not isinstance(last, BlockRemoved) or last.medium != medium:
            last = BlockRemoved(medium=medium)
            self._events.append(last)
        last.block_hashes.extend(keys)

    def copied(self, keys: list[bytes], src: str, dst: str) -> None:
        """`dst` now holds these blocks too, copied from `src` (an offload, a load, a tier
        below writing them): announced with what `src` was announced to hold (a block never
        announced: without parent or tokens)."""
        if self._events is None:
            return
        assert self.index is not None
        for key in keys:
            self._log_store(dst, key, self.index.entry(src, key) or UNKNOWN)

    def cleared(self) -> None:
        """A reset left no block in any tier (one AllBlocksCleared says it for every tier)."""
        if self._events is not None:
            assert self.index is not None
            self.index.clear()
            self._events.append(AllBlocksCleared())

    def take_events(self) -> list[KVEvent]:
        """The events since the last call (always empty when events are off)."""
        if not self._events:
            return []
        events, self._events = self._events, []
        return events

    def take_new_blocks(self) -> list[NewBlock]:
        """The blocks cached since the last call (always empty when not tracked)."""
        if not self._new_blocks:
            return []
        new, self._new_blocks = self._new_blocks, []
        return new
