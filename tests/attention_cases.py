"""Attention inputs shared by the CPU and CUDA parity tests of the attention backends: a
layer cache filled through the real (quantizing) write path, decode metadata over shuffled
blocks, and a whole step of decodes and prefills with cached context.  The C kernel's grid of
KV dtypes and shapes (tests/unit/test_cpu_paged_attention.py) is repeated here so that the
CUDA module, run on its own, has it."""

from __future__ import annotations

from dataclasses import replace

import torch

from kvserve import kv_quant as quant
from kvserve.attention.base import AttentionMetadata, PrefillSpan
from kvserve.attention.kv_cache import LayerKVCache
from kvserve.config import key_value_dtypes

KV_DTYPES = ["float32", "bfloat16", "float16", "int8", "fp8_e4m3", "fp8_e5m2", "int4", "k8v4"]
SHAPES = [(9, 3, 64, 16), (4, 4, 128, 8), (8, 1, 72, 32), (6, 2, 36, 16)]  # H, Hkv, D, bs
CPU = torch.device("cpu")
# The C decode kernel scores 8- and 4-bit keys by their codes against the query rounded to int16
# codes (native/csrc/attention/decode_generic.h): 1/65534 of the query's largest value, about
# 1/260 of an int8 key's own rounding, yet above float32's.
CODE_KEY_DTYPES = ("int8", "int4", "k8v4")


def decode_tolerance(kv_dtype: str) -> dict[str, float]:
    """assert_close's atol and rtol for the C decode kernel against the float32 reference."""
    if kv_dtype in CODE_KEY_DTYPES:
        return {"atol": 2e-4, "rtol": 1e-3}
    return {"atol": 2e-5, "rtol": 1e-4}


def filled_cache(kv_dtype, num_blocks, block_size, heads, dim, gen, device=CPU) -> LayerKVCache:
    """Every slot written through LayerKVCache.write (random values drawn on the CPU)."""
    rows = (num_blocks, block_size, heads)

    def tensors(row_format: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        shape = (*rows, quant.stored_width(row_format, dim))
        data = torch.zeros(shape, dtype=quant.storage_dtype(row_format), device=device)
        scaled = row_format in quant.SCALED_DTYPES
        return data, torch.ones(rows, device=device) if scaled else None

    (key, key_scale), (value, value_scale) = map(tensors, key_value_dtypes(kv_dtype))
    cache = LayerKVCache(key, value, key_scale, value_scale, kv_dtype)
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


def mixed_step(
    block_size: int, gen: torch.Generator, device=CPU, prefills=None, decode_contexts=None
):
    """Decodes (by default 3, after 5, block_size and 40 cached tokens), then prefill spans
    (cached tokens, new tokens), by default 3: a fresh prompt, a chunk after 21 cached tokens,
    and a 200-token chunk (two query tiles) after 37; every new token gets a fresh slot.
    Returns (metadata, num_blocks, num_tokens)."""
    if decode_contexts is None:  # tokens cached before this step's one
        decode_contexts = [5, block_size, 40]
    prefills = [(0, 11), (21, 9), (37, 200)] if prefills is None else prefills
    num_decodes = len(decode_contexts)
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
    width = max((len(t) for t in tables[:num_decodes]), default=1)
    decode_tables = torch.zeros(num_decodes, width, dtype=torch.long)
    for row in range(num_decodes):
        decode_tables[row, : len(tables[row])] = tables[row]
    spans, start = [], num_decodes
    for row, (cached, new) in enumerate(prefills, start=num_decodes):
        spans.append(PrefillSpan(start, start + new, cached + new, tables[row].to(device)))
        start += new
    md = AttentionMetadata(
        slots.to(device), num_decodes, decode_tables.to(device),
        torch.tensor(lengths[:num_decodes], dtype=torch.long).to(device), tuple(spans),
    )  # fmt: skip
    return md, num_blocks, start


def garbage_before_window(md: AttentionMetadata, block_size: int, garbage: int):
    """`md` (windowed) with every block-table entry wholly before a sequence's first query's
    window set to block `garbage`, as a window KV cache group may leave them
    (AttentionMetadata.sliding_window): a backend that reads them attends garbage."""
    window = md.sliding_window
    tables = md.decode_block_tables.clone()
    for row, n in enumerate(md.decode_seq_lens.tolist()):
        tables[row, : max(0, n - window) // block_size] = garbage
    spans = []
    for span in md.prefills:
        first_key = max(0, span.seq_len - span.num_query - window + 1)
        table = span.block_table.clone()
        table[: first_key // block_size] = garbage
        spans.append(replace(span, block_table=table))
    return replace(md, decode_block_tables=tables, prefills=tuple(spans))


def poison_block(cache: LayerKVCache, block: int, value: float = float("nan")) -> None:
    """Fill one block's K and V with `value` (a scaled 8-bit cache: its scales, which its
    rows are multiplied by; fp8 stored unscaled: the byte 0x7f, NaN in both fp8 formats)."""
    if cache.key.dtype == torch.uint8 and cache.key_scale is None:
        cache.key[block] = 0x7F
        cache.value[block] = 0x7F
    elif cache.key_scale is not None:
        cache.key_scale[block] = value
        cache.value_scale[block] = value
    else:
        cache.key[block] = value
        cache.value[block] = value
