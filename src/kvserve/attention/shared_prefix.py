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

from kvserve.attention import bf16_prefill
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
    query's dtype, or float32 from the C kernel (bf16_prefill.py), which serves the
    unmasked bfloat16 case; [L, H] float32)."""
    if mask is None:
        result = bf16_prefill.attend(query, keys, values, False, scale, with_lse=True)
        if result is not None:
            return result  # type: ignore[return-value]
    out, lse = batched_attention_with_lse(query[None], keys[None], values[None], mask, scale)
    return out[0], lse[0]


def batched_attention_with_lse(
    query: torch.Tensor,  # [N, L, H, D]
    keys: torch.Tensor,  # [N, S, Hkv, D]
    values: torch.Tensor,
    mask: torch.Tensor | None,  # [L, S] bool, the same for all N, or None: no mask
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """N sequences of the same shape in one flash call: ([N, L, H, D], [N, L, H] float32).

    GQA without repeating K/V: each KV head's group of query heads is folded into the query
    length (L x group rows against the head's S keys), so the kernel reads each K/V block
    once per group rather than once per query head.  Measured against the group as a batch
    over K/V expanded along it: 0.35 -> 0.28 ms for W3's 64 decodes over the 1,024 shared
    keys, 3.6 -> 3.3 ms for 992 suffix tokens (one layer, 2 threads), the same outputs.  One
    call for N short suffixes instead of N calls saves ~80 us of call overhead each."""
    num_seqs, num_query, num_heads, head_dim = query.shape
    num_kv_heads = keys.shape[2]
    group = num_heads // num_kv_heads
    folded = query.view(num_seqs, num_query, num_kv_heads, group, head_dim)
    folded = folded.permute(0, 2, 3, 1, 4).reshape(num_seqs, num_kv_heads, -1, head_dim)
    attn_mask = None
    if mask is not None:  # the raw kernel takes an additive mask in the query's dtype
        bias = torch.zeros(mask.shape, dtype=query.dtype).masked_fill_(~mask, float("-inf"))
        attn_mask = bias.repeat(group, 1)[None, None]  # row (g, l) is query l's mask
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        folded, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=attn_mask, scale=scale
    )
    return _unfold(out, num_query), _unfold(lse, num_query)


def causal_attention_with_lse(
    query: torch.Tensor,  # [L, H, D]
    keys: torch.Tensor,  # [L, Hkv, D]: the query tokens' own keys
    values: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of L tokens over themselves and each (token, head)'s log-sum-exp:
    ([L, H, D] in the query's dtype, [L, H] float32).  GQA as a batch of each group's query
    heads over K/V expanded along it (folding the group into the query length, as above,
    would put a token's rows after other tokens and break the causal order)."""
    num_kv_heads = keys.shape[1]
    group = query.shape[1] // num_kv_heads
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        group_queries(query, num_kv_heads), grouped_kv(keys, group), grouped_kv(values, group),
        is_causal=True, scale=scale,
    )  # fmt: skip
    return ungroup(out), ungroup(lse)


def _unfold(x: torch.Tensor, num_query: int) -> torch.Tensor:
    """[N, Hkv, group x L, ...] (the folded layout) -> [N, L, H, ...], contiguous: with N = 1
    a reshape would return a strided view, and the model's compiled layers, specialized on
    contiguous attention outputs, would recompile for it (and run slower)."""
    num_seqs, num_kv_heads = x.shape[:2]
    x = x.view(num_seqs, num_kv_heads, -1, num_query, *x.shape[3:]).movedim(3, 1)
    return x.reshape(num_seqs, num_query, -1, *x.shape[4:]).contiguous()


def merge(
    out1: torch.Tensor, lse1: torch.Tensor, out2: torch.Tensor, lse2: torch.Tensor
) -> torch.Tensor:
    """Attention over keys A + B from attention over A and over B ([T, H, D] and [T, H] each),
    in float32: B's share of the softmax mass is sigmoid(lse2 - lse1), so the merge is one
    interpolation."""
    share = torch.sigmoid(lse2 - lse1)[..., None]
    return torch.lerp(out1.float(), out2.float(), share)
