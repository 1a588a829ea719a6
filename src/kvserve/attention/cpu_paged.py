"""CPU attention backend: decodes read the paged K/V in place through a C kernel.

Profiling the reference backend on W1 (docs/benchmarks.md) showed about half of a server's
time in decode attention: copying each sequence's blocks into a padded tensor every layer and
step, then attending over the copy.  This backend hands the decode rows to
`csrc/paged_decode.c`, which walks the block tables and reads each cached row once (8-bit rows
dequantized on the fly).
Prefills keep the reference path: their gathered context is shared by many query tokens, and
SDPA's blocked kernels are faster there.
"""

from __future__ import annotations

import ctypes

import torch

from kvserve.attention.base import AttentionMetadata
from kvserve.attention.cpu_kernels import load_paged_decode
from kvserve.attention.kv_cache import LayerKVCache
from kvserve.attention.torch_ref import TorchRefBackend
from kvserve.kv import quant

# Storage kinds of the C kernel (enum kv_kind in csrc/paged_decode.c).
_KIND_BY_DTYPE = {
    torch.float32: 0,
    torch.bfloat16: 1,
    torch.float16: 2,
    torch.int8: 3,
}
# fp8 is stored as bytes: the kernel decodes it through a 256-entry table, or, on its AVX512
# path, with shifts (e4m3 and e5m2 differ in their exponent width).
_KIND_BY_FP8 = {"fp8_e4m3": 5, "fp8_e5m2": 6}


def fp8_lookup_table(kv_dtype: str) -> torch.Tensor:
    """float32 value of each of the 256 bytes of an fp8 format, exactly as torch decodes them."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    return codes.view(quant.FP8_TORCH_DTYPES[kv_dtype]).to(torch.float32)


def _ptr(t: torch.Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr() if t is not None else None)


class CpuPagedBackend(TorchRefBackend):
    """Same outputs as TorchRefBackend (up to float32 summation order), faster decodes on CPU.
    Tensors on another device go through the reference path."""

    def __init__(self) -> None:
        self._kernel = load_paged_decode().paged_decode_attention
        self._luts = {name: fp8_lookup_table(name) for name in quant.FP8_TORCH_DTYPES}

    def _decode(
        self, query: torch.Tensor, kv_cache: LayerKVCache, md: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        if query.device.type != "cpu":
            return super()._decode(query, kv_cache, md, scale)
        num_seqs, num_heads, head_dim = query.shape
        num_kv_heads, block_size = kv_cache.key.shape[2], kv_cache.key.shape[1]
        q = query.to(torch.float32).contiguous()
        out = torch.empty_like(q)
        tables = md.decode_block_tables.to(torch.int64).contiguous()
        seq_lens = md.decode_seq_lens.to(torch.int64).contiguous()
        lut = self._luts.get(kv_cache.kv_dtype) if kv_cache.quantized else None
        failed = self._kernel(
            _ptr(q), _ptr(out), _ptr(kv_cache.key), _ptr(kv_cache.value),
            _ptr(kv_cache.key_scale), _ptr(kv_cache.value_scale), _ptr(lut),
            self._kind(kv_cache), _ptr(tables), _ptr(seq_lens),
            num_seqs, tables.shape[1], num_kv_heads, num_heads // num_kv_heads, head_dim,
            block_size, scale, torch.get_num_threads(),
        )  # fmt: skip
        if failed:
            raise MemoryError("paged decode attention: out of memory for its score buffer")
        return out.to(query.dtype)

    @staticmethod
    def _kind(kv_cache: LayerKVCache) -> int:
        if kv_cache.key.dtype == torch.uint8:
            return _KIND_BY_FP8[kv_cache.kv_dtype]
        return _KIND_BY_DTYPE[kv_cache.key.dtype]
