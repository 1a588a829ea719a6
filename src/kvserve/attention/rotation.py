"""A fixed orthogonal rotation of each head's K, V and Q, for 4-bit KV caches.

A head's key rows carry a few outlier channels (RoPE'd keys do): with one scale per (token,
head), a 4-bit grid sized for the outlier leaves the other channels two or three levels.  A
Walsh-Hadamard transform with random signs mixes every channel into every other, so the
rotated row's values are alike in size (near Gaussian) and the grid fits all of them
(QuaRot, llama.cpp's rotated q4_0 cache).  The rotation R is orthogonal:

    q R . k R = q . k            (queries rotated like the keys: the scores do not change)
    sum_o p_o (v_o R) = (sum_o p_o v_o) R   (outputs rotated back by R^T)

so attention over a rotated cache is attention over the plain one, up to rounding, and no
backend knows about it: `attend` rotates around the backend's `forward`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace

import torch

from kvserve.attention.base import AttentionBackend, AttentionMetadata
from kvserve.attention.kv_cache import LayerKVCache

ROTATION_SEED = 20_260_815  # fixed: a cache written by one process is read by the next


def _hadamard(size: int) -> torch.Tensor:
    """Sylvester's Hadamard matrix of a power-of-2 size, entries +-1."""
    h = torch.ones(1, 1)
    while h.shape[0] < size:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


# A Hadamard block mixes the channels of its own block alone: below this many, a seeded random
# orthogonal matrix mixes the whole head instead.
MIN_HADAMARD_BLOCK = 16


@functools.cache
def rotation_matrix(head_dim: int) -> torch.Tensor:
    """R [head_dim, head_dim] float32 (CPU), orthogonal: diag(random signs) x a block-diagonal
    normalized Hadamard matrix.  Its blocks are the largest power of 2 that divides head_dim
    (the whole head for 64, 128, 256; 32 for a head of 96); where that is below
    MIN_HADAMARD_BLOCK (a head of 36: blocks of 4), the Q factor of a seeded Gaussian matrix."""
    generator = torch.Generator().manual_seed(ROTATION_SEED)
    block = head_dim & -head_dim
    if block < MIN_HADAMARD_BLOCK:
        gaussian = torch.randn(head_dim, head_dim, generator=generator, dtype=torch.float64)
        q, r = torch.linalg.qr(gaussian)
        return (q * r.diagonal().sign()).float()
    hadamard = torch.block_diag(*[_hadamard(block)] * (head_dim // block)) / math.sqrt(block)
    signs = torch.randint(0, 2, (head_dim,), generator=generator).float() * 2 - 1
    return signs[:, None] * hadamard


@functools.cache
def _rotation_as(head_dim: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return rotation_matrix(head_dim).to(device=device, dtype=dtype)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """x [..., head_dim] -> x R (a new tensor)."""
    return x @ _rotation_as(x.shape[-1], x.device, x.dtype)


def unrotate(x: torch.Tensor) -> torch.Tensor:
    """x [..., head_dim] -> x R^T, the inverse of `rotate`."""
    return x @ _rotation_as(x.shape[-1], x.device, x.dtype).T


def attend(
    backend: AttentionBackend,
    query: torch.Tensor,  # [T, H, D]
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,
    kv_cache: LayerKVCache,
    metadata: AttentionMetadata,
    scale: float,
    key_offset: torch.Tensor | None = None,  # [Hkv, D], rotated (runner/key_offsets.py)
    key_channel_scale: torch.Tensor | None = None,  # [Hkv, D] (runner/key_offsets.py)
    key_sink: torch.Tensor | None = None,  # [Hkv, D] float32, as stored (kv_quant.py)
) -> torch.Tensor:
    """backend.forward, with q, k, v rotated and the output rotated back where the cache keeps
    rotated rows (kv_cache.rotated); before that the keys divided and the queries multiplied
    by the layer's channel scales, and after it the key offset subtracted from the rotated
    keys (neither changes an attention weight: runner/key_offsets.py), over the view of the
    cache that stores int4 keys near `key_sink` relative to it; the backend's own call
    elsewhere."""
    if not kv_cache.rotated:
        return backend.forward(query, key, value, kv_cache, metadata, scale)
    if key_sink is not None and kv_cache.key_dtype == "int4":
        kv_cache = replace(kv_cache, key_sink=key_sink)
    if key_channel_scale is not None:
        key = key / key_channel_scale
        tokens, heads, dim = query.shape
        grouped = query.reshape(tokens, key_channel_scale.shape[0], -1, dim)
        query = (grouped * key_channel_scale[:, None]).reshape(tokens, heads, dim)
    key = rotate(key)
    if key_offset is not None:
        key = key - key_offset
    out = backend.forward(rotate(query), key, rotate(value), kv_cache, metadata, scale)
    return unrotate(out)
