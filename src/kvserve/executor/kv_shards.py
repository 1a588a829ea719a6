"""Every rank's KV cache as one, for the prefix store with N tensor-parallel ranks.

Each rank holds its KV heads of every block (models/parallel.py).  The prefix store
(engine/prefix_store.py) reads and writes whole blocks through four tables per layer,
indexed by block id; with N ranks it is given `ShardedKVCache`s instead of rank 0's own
caches: reading rows gathers every rank's heads into the model's full head order, writing
rows hands each rank its heads.  A stored block is therefore the same with any rank count
(a store written by one rank loads on two, and back).  Each read or write is one collective
call, made on the engine thread between steps like every other.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvserve.attention.kv_cache import LayerKVCache

TABLES = ("key", "value", "key_scale", "value_scale")

# collective_rpc(method, *args): rank 0's result of the call made on every rank
CollectiveCall = Callable[..., Any]


class ShardedTable:
    """One table (K, V or a scale) of one layer across the ranks: what the store uses of a
    tensor (dtype, shape, rows by block id)."""

    def __init__(
        self, call: CollectiveCall, layer: int, name: str, local: torch.Tensor, num_heads: int
    ) -> None:
        self._call, self._layer, self._name = call, layer, name
        self.dtype = local.dtype
        self.device = torch.device("cpu")  # rows come and go through rank 0's CPU
        self.shape = torch.Size((*local.shape[:2], num_heads, *local.shape[3:]))

    def element_size(self) -> int:
        return self.dtype.itemsize

    def index_select(self, dim: int, block_ids: torch.Tensor) -> torch.Tensor:
        """The blocks' rows with every rank's heads."""
        assert dim == 0
        return self._call("gather_kv_rows", self._layer, self._name, block_ids.cpu())

    def __setitem__(self, block_ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Write the blocks' rows: each rank its heads."""
        self._call("scatter_kv_rows", self._layer, self._name, block_ids.cpu(), rows.cpu())


class ShardedKVCache:
    """One layer's tables across the ranks (the store's LayerKVTensors)."""

    def __init__(self, call: CollectiveCall, layer: int, local: LayerKVCache, heads: int) -> None:
        for name in TABLES:
            table = getattr(local, name)
            sharded = None if table is None else ShardedTable(call, layer, name, table, heads)
            setattr(self, name, sharded)

    @property
    def block_bytes(self) -> int:
        return sum(math.prod(t.shape[1:]) * t.element_size() for t in self._tables())

    def _tables(self) -> list[ShardedTable]:
        return [t for t in (getattr(self, name) for name in TABLES) if t is not None]


def gather_heads(
    rows: torch.Tensor, heads_of_ranks: Sequence[Sequence[int]], gather: CollectiveCall
) -> torch.Tensor:
    """This rank's rows [n, block_size, its heads, ...] -> every rank's, in head order (a
    collective: every rank calls it).  Shares differ by a head at most, so each is padded to
    the largest for the gather."""
    widest = max(len(heads) for heads in heads_of_ranks)
    padded = rows.new_zeros((*rows.shape[:2], widest, *rows.shape[3:]))
    padded[:, :, : rows.shape[2]] = rows
    shards = gather(padded)
    num_heads = max(max(heads) for heads in heads_of_ranks) + 1
    full = rows.new_empty((*rows.shape[:2], num_heads, *rows.shape[3:]))
    for heads, shard in zip(heads_of_ranks, shards, strict=True):
        full[:, :, list(heads)] = shard[:, :, : len(heads)]
    return full
