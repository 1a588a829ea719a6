"""The attention backend contract: metadata built once per step, forward called per layer.

A step's flattened tokens are ordered decodes first (one query token each), then prefills
(one or more query tokens, possibly after cached context):

    tokens: [ d0 d1 ... d(B_d-1) | p0 p0 p0 p0 | p1 p1 | ... ]
             num_decode_tokens     prefill spans (query_start, query_end)

A backend writes each new token's K/V into its slot, then attends each query over its
sequence's blocks up to its own position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from kvserve.attention.kv_cache import LayerKVCache


@dataclass(frozen=True)
class PrefillSpan:
    query_start: int  # index of the first query token in the flat batch
    query_end: int  # one past the last
    seq_len: int  # context length after this step (cached + new tokens)
    block_table: torch.Tensor  # [ceil(seq_len / block_size)] block ids

    @property
    def num_query(self) -> int:
        return self.query_end - self.query_start


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] slot of each new token
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # [B_d, max_blocks] block ids (padded with 0)
    decode_seq_lens: torch.Tensor  # [B_d] context length incl. the new token
    prefills: tuple[PrefillSpan, ...]
    # Leading blocks that every sequence of the step shares (a common prompt prefix); a
    # backend may attend them once for all the sequences whose query tokens all come after
    # them.  Only prefill chunks may start inside them (they attend as usual).
    shared_prefix_blocks: int = 0


class AttentionBackend(Protocol):
    """What the model needs from an attention implementation.

    A backend class may set `graph_safe_decode = True` when its decode-only forward can be
    recorded in a CUDA graph (static shapes for a given batch size and block-table width, no
    host sync): the runner then captures decode graphs; a backend without it decodes eagerly.
    The declaration is not inherited: a subclass declares it again for its own decode."""

    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: LayerKVCache,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        ...
