"""Which cached-but-free entry to evict next (--prefix-cache-eviction lru|arc).  Pure Python.

The device pool keeps its free cached blocks here (item: block id) and the host tier its
slots (item: the key itself).  An entry is *pushed* when it becomes evictable (its last
reference dropped, or its copy offloaded), *removed* when it is used again (a hit takes a
reference), and *popped* when room is needed.  `reused` says the entry was a hit at least
once since it was cached: that is the frequency signal.

    lru: one queue, least recently pushed first (vLLM's free block queue).
    arc: Adaptive Replacement Cache (Megiddo and Modha, FAST 2003) over the free entries:

        T1 (seen once, LRU) | T2 (reused, LRU)        B1, B2: keys evicted from T1, T2
        evict from T1 while |T1| > p (or T2 is empty), else from T2

    A key computed again after its eviction from T1 (a B1 ghost hit) says recency was
    undervalued: p grows; one evicted from T2 (B2) shrinks it.  A one-off prompt never
    leaves T1, so a burst of them (even larger than the cache) evicts each other while a
    system prompt shared by a trickle of requests sits in T2 (tests/unit/test_eviction.py).

Retention priority (a request's ``kv_retention_priority``, 0-100, TensorRT-LLM's
``KvCacheRetentionConfig``): `PrioritizedEviction` keeps one policy per priority and evicts
from the lowest priority first; within one priority the policy decides.  Every operation is
O(1) but for sorting the levels when one becomes non-empty (O(levels), at most 101).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import NamedTuple, Protocol

from kvserve.config import PREFIX_CACHE_EVICTIONS


class EvictionPolicy(Protocol):
    """A set of evictable entries (items), each known by the content key it holds."""

    def push(self, item: Hashable, key: bytes, reused: bool) -> None: ...

    def remove(self, item: Hashable) -> None: ...

    def pop(self) -> Hashable: ...

    def note_cached(self, key: bytes) -> bool: ...

    def clear(self) -> None: ...

    def __len__(self) -> int: ...

    def __contains__(self, item: object) -> bool: ...

    def __iter__(self) -> Iterator[Hashable]: ...


class LRUPolicy:
    """Least recently pushed first; `reused` is ignored."""

    def __init__(self) -> None:
        self._queue: OrderedDict[Hashable, None] = OrderedDict()

    def push(self, item: Hashable, key: bytes, reused: bool) -> None:
        self._queue[item] = None

    def remove(self, item: Hashable) -> None:
        del self._queue[item]

    def pop(self) -> Hashable:
        return self._queue.popitem(last=False)[0]

    def note_cached(self, key: bytes) -> bool:
        """LRU keeps no history: a key computed again is never a ghost hit."""
        return False

    def clear(self) -> None:
        self._queue.clear()

    def __len__(self) -> int:
        return len(self._queue)

    def __contains__(self, item: object) -> bool:
        return item in self._queue

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._queue)


class ARCPolicy:
    """ARC over the evictable entries; `capacity` (the tier's size) bounds p and each ghost
    list.  Ghosts hold keys only (no content): a ghost hit is a miss that ARC learns from."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.p = 0.0  # target size of T1
        self._t1: OrderedDict[Hashable, bytes] = OrderedDict()  # item -> key, LRU first
        self._t2: OrderedDict[Hashable, bytes] = OrderedDict()
        self._b1: OrderedDict[bytes, None] = OrderedDict()
        self._b2: OrderedDict[bytes, None] = OrderedDict()

    def push(self, item: Hashable, key: bytes, reused: bool) -> None:
        (self._t2 if reused else self._t1)[item] = key

    def remove(self, item: Hashable) -> None:
        if self._t1.pop(item, None) is None:
            del self._t2[item]

    def pop(self) -> Hashable:
        if self._t1 and (len(self._t1) > self.p or not self._t2):
            item, key = self._t1.popitem(last=False)
            self._remember(self._b1, key)
        else:
            item, key = self._t2.popitem(last=False)
            self._remember(self._b2, key)
        return item

    def _remember(self, ghosts: OrderedDict[bytes, None], key: bytes) -> None:
        ghosts[key] = None
        if len(ghosts) > self.capacity:
            ghosts.popitem(last=False)

    def note_cached(self, key: bytes) -> bool:
        """`key` was computed (or stored) again: a ghost hit adapts p and returns True (the
        entry then counts as reused: it was wanted twice)."""
        if key in self._b1:
            self.p = min(self.capacity, self.p + max(1.0, len(self._b2) / len(self._b1)))
            del self._b1[key]
            return True
        if key in self._b2:
            self.p = max(0.0, self.p - max(1.0, len(self._b1) / len(self._b2)))
            del self._b2[key]
            return True
        return False

    def clear(self) -> None:
        """Forget the entries and the history (a prefix cache reset)."""
        for entries in (self._t1, self._t2, self._b1, self._b2):
            entries.clear()
        self.p = 0.0

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, item: object) -> bool:
        return item in self._t1 or item in self._t2

    def __iter__(self) -> Iterator[Hashable]:
        yield from self._t1
        yield from self._t2


def make_policy(name: str, capacity: int) -> Callable[[], EvictionPolicy]:
    """A factory of `name`'s policy (one of PREFIX_CACHE_EVICTIONS) for a tier of `capacity`."""
    if name == "lru":
        return LRUPolicy
    if name == "arc":
        return lambda: ARCPolicy(capacity)
    raise ValueError(
        f"eviction policy must be one of {', '.join(PREFIX_CACHE_EVICTIONS)}, got {name!r}"
    )


class Victim(NamedTuple):
    item: Hashable
    retention_priority: int


class PrioritizedEviction:
    """One policy per retention priority; the lowest non-empty priority gives the victim."""

    def __init__(self, name: str, capacity: int) -> None:
        self.name = name
        self._make = make_policy(name, capacity)
        self._levels: dict[int, EvictionPolicy] = {}
        self._non_empty: list[int] = []  # sorted priorities with entries
        self._level_of: dict[Hashable, int] = {}

    def push(self, item: Hashable, key: bytes, reused: bool, priority: int) -> None:
        assert item not in self._level_of, f"{item!r} pushed twice"
        level = self._levels.get(priority)
        if level is None:
            level = self._levels[priority] = self._make()
        if not level:
            self._non_empty.append(priority)
            self._non_empty.sort()  # at most 101 levels; only when a level fills
        level.push(item, key, reused)
        self._level_of[item] = priority

    def remove(self, item: Hashable) -> bool:
        """Take `item` out (it is used again); False when it was not here."""
        priority = self._level_of.pop(item, None)
        if priority is None:
            return False
        level = self._levels[priority]
        level.remove(item)
        if not level:
            self._non_empty.remove(priority)
        return True

    def priority_of(self, item: Hashable) -> int | None:
        """The retention priority `item` was pushed with; None when it is not here."""
        return self._level_of.get(item)

    def pop(self) -> Victim:
        """The next victim and its priority; IndexError when empty."""
        priority = self._non_empty[0]
        level = self._levels[priority]
        item = level.pop()
        del self._level_of[item]
        if not level:
            del self._non_empty[0]
        return Victim(item, priority)

    def note_cached(self, key: bytes) -> bool:
        """Whether `key` is a ghost of any priority (see ARCPolicy.note_cached)."""
        return any([level.note_cached(key) for level in self._levels.values()])

    def clear(self) -> None:
        self._levels.clear()
        self._non_empty.clear()
        self._level_of.clear()

    def __len__(self) -> int:
        return len(self._level_of)

    def __contains__(self, item: object) -> bool:
        return item in self._level_of

    def __iter__(self) -> Iterator[Hashable]:
        """Every entry, roughly in eviction order (lowest priority first)."""
        for priority in list(self._non_empty):
            yield from self._levels[priority]
