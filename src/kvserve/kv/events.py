"""KV cache events as plain data (pure Python): what the prefix cache stored and removed.

The cache manager appends them while it works (only when events are enabled) and the engine
drains them once per step; engine/kv_events.py encodes them as vLLM does and publishes them.
Hashes are the pool keys (kv/block_hasher.py), whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BlockStored:
    """Consecutive blocks of one chain became cached: block_hashes[0]'s parent is
    `parent_block_hash`; `token_ids` are all their tokens, in order.

    `salted`: the blocks are keyed under a request's cache salt (not public).  A run of blocks
    never mixes salted and unsalted ones, so that the publisher can leave a tenant's tokens out
    of the event and still announce the public blocks before them in full."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    salted: bool = False


@dataclass
class BlockRemoved:
    block_hashes: list[bytes] = field(default_factory=list)


@dataclass
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
