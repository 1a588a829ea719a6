"""Admission to a lower tier gated on reuse (--kv-offloading-store-threshold N).  Pure Python.

Without a gate every block the device evicts is copied to the host tier, and every entry the
host drops is written to disk.  A burst of one-off long prompts then flushes the lower tiers
as it flushes the device, a system prompt that many requests share included (ARC does not
save it when the burst is longer than its ghost lists: the prompt is never seen reused).
With a threshold N > 1 a block displaces an entry of a full lower tier only once it has been
*seen* N times: computed or hit by that many requests (vLLM's offloading connector calls it
`store_threshold`; there it gates every store, here only those that would evict).

    seen:   a request computes the block (it becomes full), or a lookup hits it (any tier)
    admit:  the tier below has free room, or seen(key) >= N   (N = 1: always, no counting)

Free room is never refused: until a tier first fills, a refusal would lose a block for
nothing.  Measured (benchmarks/admission_sim.py, docs/prefix_cache.md) the free-room rule is
what keeps multi-turn chat, whose histories are seen once before they come back, as good as
without a gate when the host holds them, and better when it does not.

The counts outlive the block: a block evicted unadmitted and computed again later is seen
twice, and is admitted at its next eviction.  They are bounded (the oldest counts are
forgotten first), so memory stays O(capacity) whatever the traffic.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

MAX_COUNTED_KEYS = 1 << 18  # ~256k keys, tens of MB at most


class ReuseAdmission:
    """How many times each block key was seen, and whether a key may go down a tier."""

    def __init__(self, threshold: int = 1, capacity: int = MAX_COUNTED_KEYS) -> None:
        """`threshold`: the times a key must be seen before it is admitted (1: every key);
        `capacity`: the keys whose counts are kept (least recently seen forgotten first)."""
        if threshold < 1:
            raise ValueError(f"a store threshold is >= 1, got {threshold}")
        self.threshold = threshold
        self.capacity = max(1, capacity)
        self._seen: OrderedDict[bytes, int] = OrderedDict()
        self.num_refused = 0  # evicted or dropped blocks not admitted below

    def see(self, keys: Iterable[bytes]) -> None:
        """These keys were computed or hit once more (by one request each)."""
        if self.threshold == 1:
            return
        seen = self._seen
        for key in keys:
            seen[key] = seen.pop(key, 0) + 1
        while len(seen) > self.capacity:
            seen.popitem(last=False)

    def admits(self, key: bytes) -> bool:
        """Whether `key` may be stored in the tier below the one evicting it (a refusal is
        counted in num_refused)."""
        if self.threshold == 1 or self._seen.get(key, 0) >= self.threshold:
            return True
        self.num_refused += 1
        return False

    def times_seen(self, key: bytes) -> int:
        """How many times `key` was seen (0 with threshold 1: nothing is counted)."""
        return self._seen.get(key, 0)
