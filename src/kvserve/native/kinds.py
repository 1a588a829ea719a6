"""How the native library's arrays are stored, and the tensors of a KV cache as it reads them.

`Kind` is csrc/common/kinds.h's enum kv_kind, value for value: the one definition of the codes
in C, which tests/unit/test_native_ops.py reads and compares with this one.
"""

from __future__ import annotations

import functools
from enum import IntEnum
from typing import Protocol

import torch


class Kind(IntEnum):
    """How an array's elements are stored: csrc/common/kinds.h's enum kv_kind, value for value
    (tests/unit/test_native_ops.py reads the header and compares)."""

    F32 = 0
    BF16 = 1
    F16 = 2
    I8 = 3
    E4M3 = 5
    E5M2 = 6
    I4 = 7  # two 4-bit codes a byte (kv_quant.py's int4)


_KIND_OF_DTYPE = {
    torch.float32: Kind.F32,
    torch.bfloat16: Kind.BF16,
    torch.float16: Kind.F16,
    torch.int8: Kind.I8,
}
# fp8 and int4 are stored as bytes: the format's name tells which.
_KIND_OF_BYTES = {"fp8_e4m3": Kind.E4M3, "fp8_e5m2": Kind.E5M2, "int4": Kind.I4}
STORAGE_DTYPE = {
    Kind.F32: torch.float32,
    Kind.BF16: torch.bfloat16,
    Kind.F16: torch.float16,
    Kind.I8: torch.int8,
    Kind.E4M3: torch.uint8,
    Kind.E5M2: torch.uint8,
    Kind.I4: torch.uint8,
}
FP8_DTYPE = {Kind.E4M3: torch.float8_e4m3fn, Kind.E5M2: torch.float8_e5m2}


def kind_of(dtype: torch.dtype, kv_dtype: str = "") -> Kind:
    """The kind of a tensor of `dtype`; bytes (uint8) are fp8 or int4, `kv_dtype` says which
    ("fp8_e4m3", "fp8_e5m2" or "int4").  KeyError for a dtype the kernels do not store."""
    return _KIND_OF_BYTES[kv_dtype] if dtype == torch.uint8 else _KIND_OF_DTYPE[dtype]


@functools.cache
def fp8_lookup_table(kind: Kind) -> torch.Tensor:
    """float32 value of each of the 256 bytes of an fp8 kind, exactly as torch decodes them:
    the decode kernel's general path reads fp8 rows through it."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    return codes.view(FP8_DTYPE[kind]).to(torch.float32)


class KVTensors(Protocol):
    """One layer's KV cache as the kernels read it (attention/kv_cache.py's LayerKVCache)."""

    key: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim], storage dtype
    value: torch.Tensor
    key_scale: torch.Tensor | None  # [num_blocks, block_size, num_kv_heads] float32
    value_scale: torch.Tensor | None
    kv_dtype: str
    key_sink: torch.Tensor | None  # [num_kv_heads, head_dim] float32: int4 keys' (kv_quant.py)
