"""The reference backend's chunk-over-context attention (query heads folded into the query
length, no repeated K/V) against the plain repeated-heads computation."""

from __future__ import annotations

import pytest
import torch

from kvserve.attention.torch_ref import _grouped_attention, _sequence_attention


@pytest.mark.parametrize(
    ("heads", "kv_heads", "num_query", "num_keys"),
    [(9, 3, 32, 1056), (4, 4, 7, 20), (8, 1, 16, 16), (6, 2, 1, 33)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_equals_repeated_heads(heads, kv_heads, num_query, num_keys, dtype):
    gen = torch.Generator().manual_seed(heads + num_keys)
    query = torch.randn(num_query, heads, 64, generator=gen).to(dtype)
    keys = torch.randn(num_keys, kv_heads, 64, generator=gen).to(dtype)
    values = torch.randn(num_keys, kv_heads, 64, generator=gen).to(dtype)
    positions = torch.arange(num_keys - num_query, num_keys)
    mask = torch.arange(num_keys)[None, :] <= positions[:, None]
    expected = _sequence_attention(query, keys, values, mask, 0.125)
    got = _grouped_attention(query, keys, values, mask, 0.125)
    assert got.shape == expected.shape and got.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)
