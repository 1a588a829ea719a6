"""Why prompt tokens were not served from the prefix cache: one reason per missed token.

    below_block_size  the tail a hit can never cover: the last partial block, or the whole last
                      block when the prompt ends on a block boundary (the last token is always
                      computed: its logits are needed)
    evicted           the block was cached under this very key and has since been evicted (or
                      dropped by a reset)
    isolated          the same tokens were cached recently under another key: another cache
                      salt or another KV dtype (a store written with another --kv-cache-dtype)
    never_seen        none of the above

A full block after the first miss whose own key is still cached is unusable all the same (a
hit must be a prefix); it gets the reason of the miss that broke the chain.

Classification runs once per admitted request, over its blocks (not its tokens), from two
bounded records kept as blocks are cached and removed: the keys removed recently, and a shadow
index content hash -> the key it was last cached under.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable, Sequence


class MissReason(enum.Enum):
    BELOW_BLOCK_SIZE = "below_block_size"
    ISOLATED = "isolated"
    EVICTED = "evicted"
    NEVER_SEEN = "never_seen"


MISS_REASONS = tuple(r.value for r in MissReason)
MAX_RECORD_ENTRIES = 1 << 18  # ~256k entries each, tens of MB at most


class _BoundedRecord(OrderedDict):
    """An insertion-ordered dict that forgets its oldest entries beyond `capacity`."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity

    def put(self, key: bytes, value: bytes | None = None) -> None:
        self[key] = value
        self.move_to_end(key)
        if len(self) > self.capacity:
            self.popitem(last=False)


class MissClassifier:
    """The records behind the reasons, and the classification of one lookup."""

    def __init__(self, num_blocks: int) -> None:
        capacity = min(MAX_RECORD_ENTRIES, max(1024, 4 * num_blocks))
        self._removed = _BoundedRecord(capacity)  # key -> None
        self._shadow = _BoundedRecord(capacity)  # content hash -> key

    def record_cached(self, content: bytes, key: bytes) -> None:
        self._shadow.put(content, key)
        self._removed.pop(key, None)

    def record_removed(self, key: bytes) -> None:
        self._removed.put(key)

    def classify(
        self,
        contents: Sequence[bytes],
        keys: Sequence[bytes],
        num_tokens: int,
        num_hit_tokens: int,
        block_size: int,
        is_cached: Callable[[bytes], bool],
    ) -> dict[str, int]:
        """Missed tokens of one lookup by reason (reasons with no token are left out).

        `keys`/`contents` cover at least the blocks a hit could cover,
        (num_tokens - 1) // block_size; the first num_hit_tokens // block_size were hits."""
        max_blocks = (num_tokens - 1) // block_size
        counts = {MissReason.BELOW_BLOCK_SIZE.value: num_tokens - max_blocks * block_size}
        reason = MissReason.NEVER_SEEN
        for i in range(num_hit_tokens // block_size, max_blocks):
            key = keys[i]
            if not is_cached(key):  # else: cached, but behind a miss; the same reason
                reason = self._reason(contents[i], key)
            counts[reason.value] = counts.get(reason.value, 0) + block_size
        return counts

    def _reason(self, content: bytes, key: bytes) -> MissReason:
        last_key = self._shadow.get(content)
        if key in self._removed or last_key == key:
            return MissReason.EVICTED
        if last_key is not None:
            return MissReason.ISOLATED
        return MissReason.NEVER_SEEN
