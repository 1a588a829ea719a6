"""Attention over a prefix shared by every sequence of a step, computed once for all queries.

When many requests share a prompt prefix (a system prompt, few-shot examples, W3's 1,024
tokens), their block tables start with the same blocks.  Attending each sequence over its
whole table repeats, per sequence, a pass over the same keys: at decode that is one
matrix-vector product per sequence and head, at prefill one small SDPA call per sequence.
Splitting the keys in two turns the shared part into one large matrix product for all the
step's query tokens (every query sees the whole prefix, so it needs no mask), and leaves
each sequence only its own suffix.  The two partial results are merged exactly with their
log-sum-exps (the FlashAttention / cascade-attention identity):

    out = (o1 * e^lse1 + o2 * e^lse2) / (e^lse1 + e^lse2) = o1 + (o2 - o1) * sigmoid(lse2 - lse1)

CPU only: it uses SDPA's CPU flash kernel, which returns the log-sum-exp.
"""

from __future__ import annotations

import torch

from kvserve.attention.torch_ref import group_queries, grouped_kv, ungroup

# Below this many shared tokens, or this few sequences, the split is not worth its extra
# passes (the per-sequence kernel is already cheap).
MIN_SHARED_TOKENS = 128
MIN_SEQUENCES = 4


def attention_with_lse(
    query: torch.Tensor,  # [L, H, D]
    keys: torch.Tensor,  # [S, Hkv, D]
    values: torch.Tensor,
    mask: torch.Tensor | None,  # [L, S] bool, or None: every query sees every key
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention and each (token, head)'s log-sum-exp of its scaled scores: ([L, H, D] in the
    query's dtype, [L, H] float32)."""
    num_kv_heads = keys.shape[1]
    group = query.shape[1] // num_kv_heads
    attn_mask = None
    if mask is not None:  # the raw kernel takes an additive mask in the query's dtype
        bias = torch.zeros(mask.shape, dtype=query.dtype).masked_fill_(~mask, float("-inf"))
        attn_mask = bias[None, None]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        group_queries(query, num_kv_heads),
        grouped_kv(keys, group),
        grouped_kv(values, group),
        attn_mask=attn_mask,
        scale=scale,
    )
    return ungroup(out), ungroup(lse)


def merge(
    out1: torch.Tensor, lse1: torch.Tensor, out2: torch.Tensor, lse2: torch.Tensor
) -> torch.Tensor:
    """Attention over keys A + B from attention over A and over B ([T, H, D] and [T, H] each),
    in float32: B's share of the softmax mass is sigmoid(lse2 - lse1), so the merge is one
    interpolation."""
    share = torch.sigmoid(lse2 - lse1)[..., None]
    return torch.lerp(out1.float(), out2.float(), share)
