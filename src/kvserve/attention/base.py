"""The attention backend contract: metadata built once per step, forward called per layer.

A step's flattened tokens are ordered decodes first (one query token each), then prefills
(one or more query tokens, possibly after cached context):

    tokens: [ d0 d1 ... d(B_d-1) | p0 p0 p0 p0 | p1 p1 | ... ]
             num_decode_tokens     prefill spans (query_start, query_end)

A backend writes each new token's K/V into its slot, then attends each query over its
sequence's blocks up to its own position.

A model that runs a decode step's layers in one native call (models/native_layers.py) cannot
call `forward` between them: the runner asks the backend for the step's `DecodeStepPlan`
instead (`plan_decode_step`, None by default: the layers then call `forward`) and passes it to
the model, which hands it to the native code as data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
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
    # Sliding-window attention (0: full attention).  A query at position p attends the keys at
    # positions p - sliding_window + 1 .. p (Hugging Face's convention: the window counts the
    # query's own token).  The block-table entries of blocks wholly before a sequence's first
    # query's window may hold any block id (a window KV cache group frees those blocks and the
    # runner pads their entries with 0): a backend must not read them as context.  Windowed
    # metadata has no shared prefix (with_window sets shared_prefix_blocks to 0).
    sliding_window: int = 0


def with_window(metadata: AttentionMetadata, window: int) -> AttentionMetadata:
    """The metadata of a layer that attends over the last `window` positions (0: full).  A
    window turns off the shared-prefix path: the prefix may lie outside some queries' window."""
    if metadata.sliding_window == window:
        return metadata
    shared = metadata.shared_prefix_blocks if window == 0 else 0
    return replace(metadata, sliding_window=window, shared_prefix_blocks=shared)


@dataclass(frozen=True)
class DecodeStepPlan:
    """A decode-only step's attention, the same for every layer but the cache: what
    `forward` would compute in each layer, as data (no backend type, no pointers) for a native
    decode step that attends inside its one call.  The caches' rows are stored and read as
    `forward` stores and reads them (the new K/V rows at `slots`, quantized for 8-bit caches)."""

    kv_caches: tuple[LayerKVCache, ...]  # every layer's, all of one kv_dtype and storage dtype
    tables: torch.Tensor  # [B, max_blocks] int64, contiguous: each decode's block table
    seq_lens: torch.Tensor  # [B] int64: tokens past the shared prefix (all, without one)
    slots: torch.Tensor  # [B] int64: where each decode's new K/V row goes
    block_size: int
    # A shared prefix attended once for all the decodes (0 blocks: none), its blocks, and the
    # buffers of its attention's outputs and log-sum-exps, [B, H, D] and [B, H] float32.
    prefix_blocks: int = 0
    prefix_table: torch.Tensor | None = None  # [prefix_blocks] int64
    prior_out: torch.Tensor | None = None
    prior_lse: torch.Tensor | None = None


class AttentionBackend(Protocol):
    """What the model needs from an attention implementation.  Backends subclass it, so that
    they inherit the defaults of its optional parts (`plan_decode_step`).

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

    def plan_decode_step(
        self,
        kv_caches: Sequence[LayerKVCache],
        metadata: AttentionMetadata,
        dtype: torch.dtype,  # the queries' (the model's)
        num_heads: int,  # query heads
    ) -> DecodeStepPlan | None:
        """The step's attention as data for a one-call native decode step, or None (the
        default): the model's layers call `forward` as usual."""
        return None
