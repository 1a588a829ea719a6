"""The reference backend's GQA attention (the group's query heads as a batch over K/V expanded,
not copied) against the plain computation with K/V repeated per query head."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.attention.torch_ref import _sequence_attention


@pytest.mark.parametrize(
    ("heads", "kv_heads", "num_query", "num_keys"),
    [(9, 3, 32, 1056), (4, 4, 7, 20), (8, 1, 16, 16), (6, 2, 1, 33)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_grouped_equals_repeated_heads(heads, kv_heads, num_query, num_keys, dtype, causal):
    gen = torch.Generator().manual_seed(heads + num_keys)
    query = torch.randn(num_query, heads, 64, generator=gen).to(dtype)
    keys = torch.randn(num_keys, kv_heads, 64, generator=gen).to(dtype)
    values = torch.randn(num_keys, kv_heads, 64, generator=gen).to(dtype)
    positions = torch.arange(num_keys - num_query, num_keys)
    mask = torch.arange(num_keys)[None, :] <= positions[:, None]
    if causal:
        num_keys = num_query
        keys, values, mask = keys[:num_query], values[:num_query], None
    group = heads // kv_heads
    expected = F.scaled_dot_product_attention(
        query.transpose(0, 1),
        keys.repeat_interleave(group, dim=1).transpose(0, 1),
        values.repeat_interleave(group, dim=1).transpose(0, 1),
        attn_mask=None if causal else mask,
        is_causal=causal,
        scale=0.125,
    ).transpose(0, 1)
    got = _sequence_attention(query, keys, values, mask, 0.125)
    assert got.shape == expected.shape and got.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)
