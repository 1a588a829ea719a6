"""Why prompt tokens were not served from the prefix cache: one reason per missed token.

    below_block_size  the tail a hit can never cover: the last partial block, or the whole last
                      block when the prompt ends on a block boundary (the last token is always
                      computed: its logits are needed)
    evicted           the block was cached under this very key and has since been evicted (or
                      dropped by a reset); split by the tier it last fell out of, the lowest
                      that held it: device (no host tier, or not admitted to it), host (not
                      admitted to disk, or no disk tier) or disk (its file deleted)
    isolated          the same tokens were cached recently under another key: another KV
                      dtype (a store written with another --kv-cache-dtype), or, only when
                      the operator asks (--enable-cross-salt-miss-reason), another cache salt
    never_seen        none of the above

Another salt is not a reason by default: /metrics would then tell any client, block by block,
whether a tenant under another salt sent the same prompt prefix.

A full block after the first miss whose own key is still cached is unusable all the same (a
hit must be a prefix); it gets the reason of the miss that broke the chain.

Classification runs once per admitted request, over its blocks (not its tokens), from two
bounded records kept as blocks are cached and removed: the keys removed recently, and a shadow
index content hash (kv/block_hasher.py, no namespace) -> the key it was last cached under.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Container, Sequence
from dataclasses import dataclass, field


class MissReason(enum.Enum):
    BELOW_BLOCK_SIZE = "below_block_size"
    ISOLATED = "isolated"
    EVICTED = "evicted"
    NEVER_SEEN = "never_seen"


MISS_REASONS = tuple(r.value for r in MissReason)
# the values as plain strings: the classification loop reads them (an enum member's .value
# is a descriptor call)
_BELOW, _ISOLATED, _EVICTED, _NEVER_SEEN = MISS_REASONS
# the tiers an evicted block can fall out of, top down (kv/host_tier.py, kv/disk_tier.py)
TIER_DEVICE, TIER_HOST, TIER_DISK = EVICTED_TIERS = ("device", "host", "disk")
MAX_RECORD_ENTRIES = 1 << 18  # ~256k entries each, tens of MB at most


class _BoundedRecord(OrderedDict):
    """An insertion-ordered dict that forgets its oldest entries beyond `capacity`."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity

    def put(self, key: bytes | int, value: bytes | str | None = None) -> None:
        self[key] = value
        self.move_to_end(key)
        if len(self) > self.capacity:
            self.popitem(last=False)


@dataclass
class Misses:
    """One lookup's missed tokens by reason (reasons with no token left out), and the
    `evicted` ones by the tier they fell out of (tiers with no token left out)."""

    by_reason: dict[str, int]
    evicted_by_tier: dict[str, int] = field(default_factory=dict)


class MissClassifier:
    """The records behind the reasons, and the classification of one lookup."""

    def __init__(self, num_blocks: int, report_cross_salt: bool = False) -> None:
        capacity = min(MAX_RECORD_ENTRIES, max(1024, 4 * num_blocks))
        self._removed = _BoundedRecord(capacity)  # key -> the tier it fell out of
        self._shadow = _BoundedRecord(capacity)  # content hash -> key
        self._foreign = _BoundedRecord(capacity)  # keys of another KV dtype's store -> None
        self.report_cross_salt = report_cross_salt

    def record_foreign(self, contents: Sequence[int], keys: Sequence[bytes]) -> None:
        """These contents were cached under these keys of another KV dtype (a store on disk):
        missing them is `isolated` whatever `report_cross_salt` says."""
        self.record_cached(contents, keys)
        for key in keys:
            self._foreign.put(key)

    def record_cached(self, contents: Sequence[int], keys: Sequence[bytes]) -> None:
        """These blocks were cached (under these keys)."""
        shadow, removed = self._shadow, self._removed
        for content, key in zip(contents, keys, strict=True):
            shadow[content] = key
            shadow.move_to_end(content)
            if removed:
                removed.pop(key, None)
        while len(shadow) > shadow.capacity:
            shadow.popitem(last=False)

    def record_removed(self, key: bytes, tier: str = TIER_DEVICE) -> None:
        """`key` is held by no tier any more; `tier` is the lowest that held it."""
        self._removed.put(key, tier)

    def classify(
        self,
        contents: Sequence[int],
        keys: Sequence[bytes],
        num_tokens: int,
        num_hit_tokens: int,
        block_size: int,
        cached_keys: Container[bytes],
    ) -> Misses:
        """Missed tokens of one lookup by reason, the evicted ones by tier.

        `keys`/`contents` cover at least the blocks a hit could cover,
        (num_tokens - 1) // block_size; the first num_hit_tokens // block_size were hits.
        An evicted key the bounded record forgot (its content still in the shadow index)
        counts as fallen out of the device."""
        max_blocks = (num_tokens - 1) // block_size
        counts = {_BELOW: num_tokens - max_blocks * block_size}
        tiers: dict[str, int] = {}
        reason, tier = _NEVER_SEEN, TIER_DEVICE
        shadow, removed = self._shadow, self._removed
        for i in range(num_hit_tokens // block_size, max_blocks):
            key = keys[i]
            if key not in cached_keys:  # else: cached, but behind a miss; the same reason
                last_key = shadow.get(contents[i])
                if last_key == key or key in removed:
                    reason, tier = _EVICTED, removed.get(key) or TIER_DEVICE
                elif last_key is not None and (self.report_cross_salt or last_key in self._foreign):
                    reason = _ISOLATED
                else:
                    reason = _NEVER_SEEN
            counts[reason] = counts.get(reason, 0) + block_size
            if reason == _EVICTED:
                tiers[tier] = tiers.get(tier, 0) + block_size
        return Misses(counts, tiers)
