"""What the prefix cache did, kept for the world outside the engine step (pure Python): KV
events for subscribers (kv/events.py) and the blocks cached since the last save, for the store
on disk.  Each half is off (None, nothing recorded) unless asked for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


@dataclass(frozen=True)
class NewBlock:
    """A block cached since the last `take_new_blocks`, with what it takes to store it."""

    block_id: int
    key: bytes
    content: int  # the statistics-only content hash (kv/block_hasher.py)
    parent_key: bytes | None
    token_ids: list[int]


class CacheLog:
    def __init__(self, block_size: int, enable_events: bool, track_new_blocks: bool) -> None:
        self.block_size = block_size
        self._events: list[KVEvent] | None = [] if enable_events else None
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
        events = self._events
        for i in indices:
            parent = keys[i - 1] if i else None
            tokens = list(token_ids[i * size : (i + 1) * size])
            if self._new_blocks is not None:
                self._new_blocks.append(NewBlock(table[i], keys[i], contents[i], parent, tokens))
            if events is None:
                continue
            salted = i >= num_unsalted
            last = events[-1] if events else None
            if (
                isinstance(last, BlockStored)
                and last.block_hashes[-1] == parent
                and last.salted == salted
            ):
                last.block_hashes.append(keys[i])
                last.token_ids.extend(tokens)
            else:
                events.append(BlockStored([keys[i]], parent, list(tokens), size, salted))

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
        """A cached block was evicted to make room (consecutive evictions: one event)."""
        if self._events is not None:
            last = self._events[-1] if self._events else None
            if not isinstance(last, BlockRemoved):
                last = BlockRemoved()
                self._events.append(last)
            last.block_hashes.append(key)

    def dropped(self, keys: list[bytes], none_left: bool) -> None:
        """A reset dropped these cached blocks; `none_left`: no block is cached any more."""
        if self._events is not None and keys:
            self._events.append(AllBlocksCleared() if none_left else BlockRemoved(keys))

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
