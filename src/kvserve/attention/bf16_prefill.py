"""A bfloat16 prefill chunk's attention through the native library's prefill kernel
(native/csrc/attention/prefill_bf16.c): on AMX tiles where the CPU has them, else with
AVX512-BF16 dot products.

PyTorch's CPU flash kernel attends a 256-token causal prompt of the embedded model in ~290 us
a layer on two AMX cores (~240 GFLOP/s), and in ~1.1 ms on two AVX512-BF16 cores without AMX
(AMD Zen).  The C kernel runs both matrix products on AMX tiles (or vdpbf16ps) and the
softmax exactly, in two passes per block of 16 query rows: on AMX, 174 us for the same
prompt, 1.7 ms against 3.0 for 1,024 tokens (docs/decisions/prefill-kernel.md).
The probabilities are rounded to bfloat16 before P x V, as the flash kernel rounds them.
Where the build or the CPU has no AVX512-BF16, or the tensors do not fit the kernel (float32,
a head size not a multiple of 32), `attend` returns None and the caller keeps SDPA.
"""

from __future__ import annotations

import functools

import torch

from kvserve.native import ops


def _fits(x: torch.Tensor) -> bool:
    """[sequences, tokens, heads, dim] bfloat16 on the CPU, each token's heads x dim
    contiguous."""
    return (
        x.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and x.stride(3) == 1
        and x.stride(2) == x.shape[3]
        and x.shape[3] % 32 == 0
        and x.shape[3] <= 256
    )


# Engines of the C kernel: the best this CPU has (AMX tiles where the OS grants them), or
# AVX512-BF16 vectors alone (the path of CPUs without AMX, which tests also run on AMX CPUs).
BEST, VECTORS = 0, 1


@functools.cache
def prefill_kernel_available() -> bool:
    """The kernel runs here: built with AVX512-BF16 (the compiler and the CPU have it)."""
    probe = torch.zeros(1, 1, 32, dtype=torch.bfloat16)
    return ops.available() and attend(probe, probe, probe, True, 1.0) is not None


def attend(
    query: torch.Tensor,  # [L, H, D] bfloat16
    keys: torch.Tensor,  # [S, Hkv, D]
    values: torch.Tensor,
    causal: bool,  # query t sees keys up to t + S - L (the chunk ends the sequence)
    scale: float,
    with_lse: bool = False,
    engine: int = BEST,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Attention ([L, H, D] bfloat16; with `with_lse`, float32 and each (token, head)'s
    log-sum-exp [L, H]), or None where the kernel does not serve these tensors."""
    result = attend_batch(query[None], keys[None], values[None], causal, scale, with_lse, engine)
    if result is None:
        return None
    out, lse = result
    return out[0], None if lse is None else lse[0]


def attend_batch(
    query: torch.Tensor,  # [N, L, H, D] bfloat16
    keys: torch.Tensor,  # [N, S, Hkv, D]
    values: torch.Tensor,
    causal: bool,
    scale: float,
    with_lse: bool = False,
    engine: int = BEST,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """`attend` for N sequences of one shape in one call ([N, L, H, D], [N, L, H]): W3's 30
    suffixes of 32 tokens cost ~50 us each as separate calls (buffers, threads, arguments),
    ~10x their arithmetic."""
    if values.shape != keys.shape or keys.shape[0] != query.shape[0]:
        return None
    return _attend(query, keys, values, keys.shape[1], None, causal, scale, with_lse, engine)


def attend_paged(
    query: torch.Tensor,  # [N, L, H, D] bfloat16
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]: a layer's cache, read in place
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [N, blocks] int64: each sequence's first S keys' blocks
    num_keys: int,  # S
    causal: bool,
    scale: float,
    with_lse: bool = False,
    engine: int = BEST,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """`attend_batch` over keys that a bf16 paged cache holds, without gathering them first
    (the kernel packs K and V from the blocks): W3's shared prefix, read by every step, cost a
    gather of 2 x 1,024 x 3 x 64 values a layer.  Blocks of a multiple of 16 tokens."""
    num_blocks, block_size = key_cache.shape[:2]
    if (
        value_cache.shape != key_cache.shape
        or not (key_cache.is_contiguous() and value_cache.is_contiguous())
        or block_tables.dtype != torch.int64
        or block_tables.stride(1) != 1
        or block_tables.shape[0] != query.shape[0]
        or block_tables.shape[1] * block_size < num_keys
    ):
        return None
    flat_k, flat_v = (
        x.view(1, num_blocks * block_size, *x.shape[2:]) for x in (key_cache, value_cache)
    )
    table = (block_tables, block_size)
    return _attend(query, flat_k, flat_v, num_keys, table, causal, scale, with_lse, engine)


def _attend(
    query: torch.Tensor,
    keys: torch.Tensor,  # [N or 1, >= S, Hkv, D]
    values: torch.Tensor,
    num_keys: int,
    table: tuple[torch.Tensor, int] | None,  # (block tables [N, blocks], block size)
    causal: bool,
    scale: float,
    with_lse: bool,
    engine: int,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    if not ops.available() or not all(_fits(x) for x in (query, keys, values)):
        return None
    (num_seqs, num_query, num_heads, dim), num_kv_heads = query.shape, keys.shape[2]
    if causal and num_keys < num_query or num_heads % num_kv_heads:
        return None
    out_dtype = torch.float32 if with_lse else torch.bfloat16
    out = torch.empty((num_seqs, num_query, num_heads, dim), dtype=out_dtype)
    lse = torch.empty((num_seqs, num_query, num_heads), dtype=torch.float32) if with_lse else None
    tables, block_size = table if table is not None else (None, 0)
    done = ops.kernels().prefill_attention(
        query, keys, values, num_keys, causal, scale, out, lse, engine, tables, block_size
    )
    return (out, lse) if done else None
