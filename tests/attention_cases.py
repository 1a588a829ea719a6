"""Attention inputs shared by the CPU and CUDA parity tests of the attention backends: a
layer cache filled through the real (quantizing) write path, decode metadata over shuffled
blocks, and a whole step of decodes and prefills with cached context.  The C kernel's grid of
KV dtypes and shapes (tests/unit/test_cpu_paged_attention.py) is repeated here so that the
CUDA module, run on its own, has it."""

from __future__ import annotations

import torch

from kvserve.attention import quant
from kvserve.attention.base import AttentionMetadata, PrefillSpan
from kvserve.attention.kv_cache import LayerKVCache

KV_DTYPES = ["float32", "bfloat16", "float16", "int8", "fp8_e4m3", "fp8_e5m2"]
SHAPES = [(9, 3, 64, 16), (4, 4, 128, 8), (8, 1, 72, 32), (6, 2, 36, 16)]  # H, Hkv, D, bs
CPU = torch.device("cpu")


def filled_cache(kv_dtype, num_blocks, block_size, heads, dim, gen, device=CPU) -> LayerKVCache:
    """Every slot written through LayerKVCache.write (random values drawn on the CPU)."""
    shape = (num_blocks, block_size, heads, dim)
    scaled = kv_dtype in quant.SCALED_DTYPES
    store = quant.storage_dtype(kv_dtype)
    cache = LayerKVCache(
        torch.zeros(shape, dtype=store, device=device),
        torch.zeros(shape, dtype=store, device=device),
        torch.ones(shape[:3], device=device) if scaled else None,
        torch.ones(shape[:3], device=device) if scaled else None,
        kv_dtype,
    )
    slots = torch.arange(num_blocks * block_size, device=device)
    keys = torch.randn(len(slots), heads, dim, generator=gen).to(device)
    values = torch.randn(len(slots), heads, dim, generator=gen).to(device)
    cache.write(slots, keys, values)
    return cache


def decode_metadata(seq_lens: list[int], num_blocks: int, block_size: int, gen):
    """Each sequence gets distinct, shuffled blocks; tables padded with block 0 like the runner."""
    width = max(-(-n // block_size) for n in seq_lens)
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.long)
    used = 0
    for row, n in enumerate(seq_lens):
        count = -(-n // block_size)
        tables[row, :count] = order[used : used + count]
        used += count
    lens = torch.tensor(seq_lens)
    return AttentionMetadata(torch.zeros(0, dtype=torch.long), len(seq_lens), tables, lens, ())


def decode_case(kv_dtype: str, heads: int, kv_heads: int, dim: int, block_size: int):
    """The decode grid's case for one KV dtype and shape: (query, cache, metadata, scale,
    the reference's output), sequences from 1 token to several blocks on shuffled blocks."""
    from kvserve.attention.torch_ref import TorchRefBackend

    gen = torch.Generator().manual_seed(heads * 1000 + dim)
    seq_lens = [1, block_size, block_size + 1, 3 * block_size - 1, 77, 5]
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    cache = filled_cache(kv_dtype, num_blocks, block_size, kv_heads, dim, gen)
    md = decode_metadata(seq_lens, num_blocks, block_size, gen)
    query = torch.randn(len(seq_lens), heads, dim, generator=gen)
    scale = dim**-0.5
    return query, cache, md, scale, TorchRefBackend()._decode(query, cache, md, scale)


def mixed_step(block_size: int, gen: torch.Generator, device=CPU, prefills=None):
    """3 decodes, then prefill spans (cached tokens, new tokens), by default 3: a fresh
    prompt, a chunk after 21 cached tokens, and a 200-token chunk (two query tiles) after 37;
    every new token gets a fresh slot.  Returns (metadata, num_blocks, num_tokens)."""
    decode_contexts = [5, block_size, 40]  # tokens cached before this step's one
    prefills = prefills or [(0, 11), (21, 9), (37, 200)]
    lengths = [n + 1 for n in decode_contexts] + [c + n for c, n in prefills]
    num_blocks = sum(-(-n // block_size) for n in lengths) + 2
    order = torch.randperm(num_blocks, generator=gen)
    tables, used = [], 0
    for n in lengths:
        count = -(-n // block_size)
        tables.append(order[used : used + count])
        used += count
    new_positions = [[n] for n in decode_contexts] + [list(range(c, c + n)) for c, n in prefills]
    slots = torch.cat(
        [tables[i][torch.tensor(p) // block_size] * block_size + torch.tensor(p) % block_size
         for i, p in enumerate(new_positions)]
    )  # fmt: skip
    width = max(len(t) for t in tables[:3])
    decode_tables = torch.zeros(3, width, dtype=torch.long)
    for row in range(3):
        decode_tables[row, : len(tables[row])] = tables[row]
    spans, start = [], 3
    for row, (cached, new) in enumerate(prefills, start=3):
        spans.append(PrefillSpan(start, start + new, cached + new, tables[row].to(device)))
        start += new
    md = AttentionMetadata(
        slots.to(device), 3, decode_tables.to(device), torch.tensor(lengths[:3]).to(device),
        tuple(spans),
    )  # fmt: skip
    return md, num_blocks, start
