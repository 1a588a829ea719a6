"""KV memory accounting: the one function the engine's sizing, the planner and the metrics use.

    KV bytes = 2 (K and V) x tokens x layers x kv_heads x head_dim x bytes_per_value
               (+ scale bytes for 8-bit dtypes that need them)

Pure Python (no torch): the planner must run without a model or a device.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.errors import ParameterError

# Bytes of one stored value for each KV dtype name ("auto" resolves to the model dtype first).
DTYPE_BYTES = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "int8": 1,
}

# 8-bit formats with a narrow range keep one float32 scale per (token, kv head) for K and for
# V; e5m2 has the range of fp16 and needs none.  See attention/quant.py for why this granularity.
SCALE_BYTES_PER_TOKEN_HEAD = {"fp8_e4m3": 4, "int8": 4}


def resolve_kv_dtype(kv_cache_dtype: str, model_dtype: str) -> str:
    """Map a --kv-cache-dtype value to a storage dtype name: auto -> model dtype, fp8 -> e4m3."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "fp8":
        return "fp8_e4m3"
    if kv_cache_dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown KV cache dtype {kv_cache_dtype!r}")
    return kv_cache_dtype


@dataclass(frozen=True)
class KVCacheSpec:
    """Bytes of KV per token and per block for one model shape on one tensor-parallel rank."""

    num_layers: int
    num_kv_heads: int  # per rank
    head_dim: int
    dtype: str  # resolved storage dtype, e.g. "bfloat16", "int8"
    block_size: int

    @property
    def bytes_per_value(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def scale_bytes_per_token_head(self) -> int:
        return SCALE_BYTES_PER_TOKEN_HEAD.get(self.dtype, 0)

    @property
    def bytes_per_token_per_layer(self) -> int:
        per_head = self.head_dim * self.bytes_per_value + self.scale_bytes_per_token_head
        return 2 * self.num_kv_heads * per_head

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * self.bytes_per_token_per_layer

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.bytes_per_token

    def num_blocks_for_tokens(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def num_blocks_in(self, budget_bytes: int) -> int:
        """How many whole blocks fit in a byte budget."""
        return max(0, budget_bytes // self.bytes_per_block)


def cdiv(numerator: int, denominator: int) -> int:
    """Ceiling division of integers (exact, unlike math.ceil of a float quotient)."""
    return -(-numerator // denominator)


def kv_heads_per_rank(num_kv_heads: int, tensor_parallel_size: int) -> int:
    """KV heads are split across ranks; with fewer heads than ranks each rank keeps a replica."""
    if tensor_parallel_size <= 0:
        raise ParameterError("--tensor-parallel-size", "must be positive")
    return max(1, cdiv(num_kv_heads, tensor_parallel_size))


def kv_cache_spec(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    kv_cache_dtype: str,
    model_dtype: str,
    block_size: int,
    tensor_parallel_size: int = 1,
) -> KVCacheSpec:
    """The accounting function: a model shape + block size + KV dtype + TP size -> KVCacheSpec."""
    return KVCacheSpec(
        num_layers=num_layers,
        num_kv_heads=kv_heads_per_rank(num_kv_heads, tensor_parallel_size),
        head_dim=head_dim,
        dtype=resolve_kv_dtype(kv_cache_dtype, model_dtype),
        block_size=block_size,
    )
