"""The rotation of a 4-bit KV cache (attention/rotation.py): orthogonal, q . k unchanged in
float32 to rounding, and attention through a rotated cache, with a key offset subtracted,
equal to attention through the plain one (the softmax cancels q . offset)."""

from __future__ import annotations

import pytest
import torch
from attention_cases import decode_metadata, filled_cache

from kvserve.attention import rotation, select_backend
from kvserve.attention.base import AttentionMetadata
from kvserve.attention.torch_ref import TorchRefBackend


@pytest.mark.parametrize("head_dim", [64, 128, 96, 36])
def test_the_rotation_is_orthogonal_and_keeps_every_dot_product(head_dim):
    r = rotation.rotation_matrix(head_dim)
    torch.testing.assert_close(r @ r.T, torch.eye(head_dim), atol=1e-6, rtol=0)
    assert not torch.equal(r.abs(), torch.eye(head_dim))  # it mixes channels
    gen = torch.Generator().manual_seed(head_dim)
    q, k = torch.randn(50, 9, head_dim, generator=gen), torch.randn(50, 9, head_dim, generator=gen)
    k[..., 3] *= 30  # an outlier channel, as RoPE'd keys have
    plain = (q * k).sum(-1)
    rotated = (rotation.rotate(q) * rotation.rotate(k)).sum(-1)
    torch.testing.assert_close(rotated, plain, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(rotation.unrotate(rotation.rotate(q)), q, atol=1e-5, rtol=1e-5)
    # the outlier is spread: no rotated channel holds more than a few times its share (blocks
    # of 4 channels, a head of 36's Hadamard blocks, left 8.7x; the random rotation 4.3x)
    spread = rotation.rotate(k).pow(2).mean((0, 1))
    assert spread.max() < 6 * spread.mean()


@pytest.mark.parametrize("head_dim", [64, 36])
def test_the_rotation_is_the_same_in_every_process(head_dim):
    """Built from a fixed seed: a prefix stored by one process is read by the next (built
    again here, past the cache, as a new process builds it)."""
    assert torch.equal(rotation.rotation_matrix.__wrapped__(head_dim),
                       rotation.rotation_matrix(head_dim))  # fmt: skip


@pytest.mark.parametrize("backend_name", ["torch", "cpu-paged"])
def test_attention_through_a_rotated_cache_with_a_key_offset_is_plain_attention(backend_name):
    """Decode steps over a float32 cache that keeps rotated rows (what int4 does, without the
    4-bit rounding): the output equals the plain cache's, with any key offset subtracted and
    any channel scales dividing the keys (and multiplying the queries)."""
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, dim, block_size = 9, 3, 64, 16
    seq_lens = [1, 17, 40]
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 2
    decode = decode_metadata(seq_lens, num_blocks, block_size, gen)
    last = torch.tensor(seq_lens) - 1  # the new token's position in each sequence
    blocks = decode.decode_block_tables[torch.arange(len(seq_lens)), last // block_size]
    md = AttentionMetadata(blocks * block_size + last % block_size, len(seq_lens),
                           decode.decode_block_tables, decode.decode_seq_lens, ())  # fmt: skip
    num_slots = num_blocks * block_size
    keys = torch.randn(num_slots, kv_heads, dim, generator=gen) + 3.0  # a shared offset
    values = torch.randn(num_slots, kv_heads, dim, generator=gen)
    plain = filled_cache("float32", num_blocks, block_size, kv_heads, dim, gen)
    rotated = filled_cache("float32", num_blocks, block_size, kv_heads, dim, gen)
    rotated.rotated = True
    channel_scale = torch.rand(kv_heads, dim, generator=gen) * 4 + 0.25
    offset = rotation.rotate(keys.mean(0) / channel_scale)
    slots = torch.arange(num_slots)
    plain.write(slots, keys, values)
    rotated.write(slots, rotation.rotate(keys / channel_scale) - offset, rotation.rotate(values))
    backend = select_backend(backend_name, torch.device("cpu"))
    query = torch.randn(len(seq_lens), heads, dim, generator=gen)
    new_k = torch.randn(len(seq_lens), kv_heads, dim, generator=gen)
    new_v = torch.randn(len(seq_lens), kv_heads, dim, generator=gen)
    scale = dim**-0.5
    expected = TorchRefBackend().forward(query, new_k, new_v, plain, md, scale)
    got = rotation.attend(backend, query, new_k, new_v, rotated, md, scale, offset, channel_scale)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
