"""Pinned prefixes: cached blocks an operator keeps out of eviction (POST /v1/prefix_cache/pin).
Pure Python.

A pin holds one reference on each full block of a cached prefix, like a request that never
ends: its blocks never reach a free queue, so no eviction takes them and a prefix cache reset
(which drops only free cached blocks) leaves them unless the pins are dropped first.  The
blocks keep their hashes, so every request starting with the prefix is a hit.  Several pins
may share blocks (a prefix and its extension): the cap (--max-pinned-prefix-fraction) counts
distinct blocks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.kv.block_pool import BlockPool


class PinLimitError(ValueError):
    """Pinning would hold more blocks than the cap allows: states need, have and the cap."""

    def __init__(self, num_new: int, num_pinned: int, max_blocks: int) -> None:
        super().__init__(
            f"pinning needs {num_new} more blocks but {num_pinned} of at most {max_blocks} "
            f"are pinned; unpin a prefix or raise the cap"
        )
        self.num_new = num_new


@dataclass(frozen=True)
class Pin:
    pin_id: str
    num_tokens: int  # the pinned tokens: its full blocks' (a partial last block is not held)
    block_ids: tuple[int, ...]
    keys: tuple[bytes, ...]


class PrefixPins:
    def __init__(self, pool: BlockPool, max_blocks: int) -> None:
        """`max_blocks`: how many distinct blocks all pins together may hold."""
        self.pool = pool
        self.max_blocks = max_blocks
        self._pins: dict[str, Pin] = {}
        self._holders: Counter[int] = Counter()  # block id -> pins holding it

    @property
    def num_pinned_blocks(self) -> int:
        return len(self._holders)

    def list_pins(self) -> list[Pin]:
        return list(self._pins.values())

    def get(self, pin_id: str) -> Pin | None:
        return self._pins.get(pin_id)

    def check_room(self, keys: Sequence[bytes]) -> None:
        """PinLimitError when pinning blocks under `keys` would pass the cap (a key whose block
        is pinned already costs nothing)."""
        num_new = sum(1 for key in keys if self._pinned_block(key) is None)
        if self.num_pinned_blocks + num_new > self.max_blocks:
            raise PinLimitError(num_new, self.num_pinned_blocks, self.max_blocks)

    def _pinned_block(self, key: bytes) -> int | None:
        block_id = self.pool.lookup(key)
        return block_id if block_id is not None and block_id in self._holders else None

    def try_pin(self, pin_id: str, keys: Sequence[bytes], block_size: int) -> Pin | None:
        """Pin the blocks cached under `keys` (all of them, in order) as `pin_id`; None (and
        nothing held) when one is not cached on the device.  PinLimitError past the cap;
        ValueError for an id in use."""
        if pin_id in self._pins:
            raise ValueError(f"pin id {pin_id!r} is already in use")
        block_ids = [self.pool.lookup(key) for key in keys]
        if any(block_id is None for block_id in block_ids):
            return None
        self.check_room(keys)
        held = tuple(b for b in block_ids if b is not None)
        self.pool.touch(held)
        self._holders.update(held)
        pin = Pin(pin_id, len(keys) * block_size, held, tuple(keys))
        self._pins[pin_id] = pin
        return pin

    def unpin(self, pin_id: str) -> Pin | None:
        """Release a pin's blocks (they become evictable, cached); None when unknown."""
        pin = self._pins.pop(pin_id, None)
        if pin is None:
            return None
        self._holders.subtract(pin.block_ids)
        for block_id in set(pin.block_ids):
            if not self._holders[block_id]:
                del self._holders[block_id]
        self.pool.free(reversed(pin.block_ids))  # tail first, like a request
        return pin

    def unpin_all(self) -> int:
        """Release every pin; how many there were."""
        pin_ids = list(self._pins)
        for pin_id in pin_ids:
            self.unpin(pin_id)
        return len(pin_ids)

    def references(self) -> Counter[int]:
        """Block id -> references held by pins (for the cache manager's invariants)."""
        return Counter(b for pin in self._pins.values() for b in pin.block_ids)
