"""KV cache events as plain data (pure Python): what each tier of the prefix cache stored and
removed.

The cache manager appends them while it works (only when events are enabled) and the engine
drains them once per step; engine/kv_events.py encodes them as vLLM does and publishes them.
Hashes are the pool keys (kv/block_hasher.py), whole.

`medium` names the tier that holds (or dropped) the blocks, as vLLM names its tiers:

    GPU   the KV cache the model reads (vLLM's block pool sends "GPU" on every platform, so a
          kvserve cache on a CPU is "GPU" too: "CPU" is the host tier's name)
    CPU   the host tier (--kv-offloading-size, kv/host_tier.py), as vLLM's CPU offloading sends
    DISK  a tier on disk
"""

from __future__ import annotations

from dataclasses import dataclass, field

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_DISK = "DISK"


@dataclass
class BlockStored:
    """Consecutive blocks of one chain became cached in `medium`: block_hashes[0]'s parent is
    `parent_block_hash`; `token_ids` are all their tokens, in order (empty when the tier that
    stored them never learnt them).

    `salted`: the blocks are keyed under a request's cache salt (not public).  A run of blocks
    never mixes salted and unsalted ones, so that the publisher can leave a tenant's tokens out
    of the event and still announce the public blocks before them in full."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    salted: bool = False
    medium: str = MEDIUM_GPU


@dataclass
class BlockRemoved:
    block_hashes: list[bytes] = field(default_factory=list)
    medium: str = MEDIUM_GPU


@dataclass
class AllBlocksCleared:
    """No tier holds any block any more."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
