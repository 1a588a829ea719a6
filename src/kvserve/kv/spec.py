"""KV memory accounting: the one function the engine's sizing, the planner and the metrics use.

    KV bytes = 2 (K and V) x tokens x layers x kv_heads x head_dim x bits_per_value / 8
               (+ scale bytes for the quantized dtypes that keep them)

Pure Python (no torch): the planner must run without a model or a device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.config import SPLIT_KV_DTYPES, key_value_dtypes
from kvserve.errors import ParameterError

# Bits of one stored value for each KV dtype name ("auto" resolves to the model dtype first).
DTYPE_BITS = {
    "float32": 32,
    "bfloat16": 16,
    "float16": 16,
    "fp8_e4m3": 8,
    "fp8_e5m2": 8,
    "int8": 8,
    "int4": 4,  # two codes a byte (head_dim is even in every model kvserve loads)
}

# Formats with a narrow range keep one float32 scale per (token, kv head) for K and for V;
# e5m2 has the range of fp16 and needs none.  See kv_quant.py for why this granularity.
SCALE_BYTES_PER_TOKEN_HEAD = {"fp8_e4m3": 4, "int8": 4, "int4": 4}


def row_bytes(head_dim: int, storage_dtype: str) -> int:
    """Bytes of one head's K or V row of one token in a storage dtype, its scale included."""
    return head_dim * DTYPE_BITS[storage_dtype] // 8 + SCALE_BYTES_PER_TOKEN_HEAD.get(
        storage_dtype, 0
    )


def resolve_kv_dtype(kv_cache_dtype: str, model_dtype: str) -> str:
    """Map a --kv-cache-dtype value to a storage dtype name: auto -> model dtype, fp8 -> e4m3."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "fp8":
        return "fp8_e4m3"
    if kv_cache_dtype not in DTYPE_BITS and kv_cache_dtype not in SPLIT_KV_DTYPES:
        raise ValueError(f"unknown KV cache dtype {kv_cache_dtype!r}")
    return kv_cache_dtype


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers of one attention kind that share block tables: every sequence has one table per
    group.  `layers[j]` stores its K/V in slot j of a block (a block id belongs to one group at
    a time, and its slots hold that group's layers), so every group of a layout has at most
    `KVCacheSpec.layers_per_block` layers."""

    window: int  # sliding-window width in tokens; 0: full attention
    layers: tuple[int, ...]  # the model's layer indices

    def num_blocks_kept(self, num_tokens: int, block_size: int) -> int:
        """Blocks a sequence of `num_tokens` tokens holds in this group."""
        return blocks_kept(self.window, num_tokens, block_size)

    def describe(self) -> str:
        kind = f"sliding window {self.window}" if self.window else "full attention"
        return f"{kind}, layers {','.join(map(str, self.layers))}"


def kv_cache_groups(layer_windows: Sequence[int]) -> tuple[KVCacheGroup, ...]:
    """Layers grouped by attention kind, full attention first, vLLM's way: one kind of layer
    makes one group; with several kinds every group holds as many layers as the rarest kind
    has (each kind split into groups of that size, the last one possibly short), so one block
    size fits them all and a block of one group costs what a block of any other does."""
    kinds: dict[int, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        kinds.setdefault(window, []).append(layer)
    if len(kinds) == 1:
        [(window, layers)] = kinds.items()
        return (KVCacheGroup(window, tuple(layers)),)
    size = min(len(layers) for layers in kinds.values())
    return tuple(
        KVCacheGroup(window, tuple(layers[i : i + size]))
        for window, layers in sorted(kinds.items())
        for i in range(0, len(layers), size)
    )


@dataclass(frozen=True)
class KVCacheSpec:
    """Bytes of KV per token and per block for one model shape on one tensor-parallel rank.

    Without `groups` every layer keeps every token of a sequence in one table (the layout of
    the auxiliary caches: evaluation, the KV-dtype check, warm-up).  With them (the engine's
    cache, kv_cache_groups) a block holds `layers_per_block` layers of one group, and a
    sequence's blocks are counted per group, windows applied."""

    num_layers: int
    num_kv_heads: int  # per rank
    head_dim: int
    dtype: str  # resolved storage dtype, e.g. "bfloat16", "int8"
    block_size: int
    groups: tuple[KVCacheGroup, ...] = ()

    @property
    def layers_per_block(self) -> int:
        """Layers whose K/V one block id holds (its slots)."""
        if not self.groups:
            return self.num_layers
        return max(len(group.layers) for group in self.groups)

    def slot_of_layers(self) -> list[int]:
        """Each model layer's slot in a block."""
        if not self.groups:
            return list(range(self.num_layers))
        slots = [0] * self.num_layers
        for group in self.groups:
            for slot, layer in enumerate(group.layers):
                slots[layer] = slot
        return slots

    @property
    def bytes_per_token_per_layer(self) -> int:
        """K and V of one token in one layer: each head's row and its scale, for the keys'
        storage dtype and the values' (the same one but for k8v4)."""
        per_head = sum(row_bytes(self.head_dim, name) for name in key_value_dtypes(self.dtype))
        return self.num_kv_heads * per_head

    @property
    def bytes_per_token(self) -> int:
        """Bytes one more token costs in every layer (before any window is full)."""
        return self.num_layers * self.bytes_per_token_per_layer

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.layers_per_block * self.bytes_per_token_per_layer

    def num_blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks one sequence of `num_tokens` tokens holds (all groups together)."""
        if not self.groups:
            return cdiv(num_tokens, self.block_size)
        return sum(g.num_blocks_kept(num_tokens, self.block_size) for g in self.groups)

    def bytes_per_sequence(self, num_tokens: int) -> int:
        """KV bytes one sequence of `num_tokens` tokens holds, windows applied."""
        return self.num_blocks_for_tokens(num_tokens) * self.bytes_per_block

    def num_blocks_in(self, budget_bytes: int) -> int:
        """How many whole blocks fit in a byte budget."""
        return max(0, budget_bytes // self.bytes_per_block)


def blocks_kept(window: int, num_tokens: int, block_size: int) -> int:
    """Blocks a sequence of `num_tokens` tokens holds at most in a group of this window (0:
    full attention).  A window of W tokens rarely starts on a block boundary: it straddles at
    most ceil((W - 1) / block_size) + 1 blocks, and older ones are freed as it moves
    (planner/layers.py counts the same)."""
    blocks = cdiv(num_tokens, block_size)
    return blocks if not window else min(blocks, cdiv(window - 1, block_size) + 1)


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
    layer_windows: Sequence[int] = (),
) -> KVCacheSpec:
    """The accounting function: a model shape + block size + KV dtype + TP size -> KVCacheSpec;
    with `layer_windows` (each layer's window, 0 for full attention) the layout in KV cache
    groups (kv_cache_groups)."""
    return KVCacheSpec(
        num_layers=num_layers,
        num_kv_heads=kv_heads_per_rank(num_kv_heads, tensor_parallel_size),
        head_dim=head_dim,
        dtype=resolve_kv_dtype(kv_cache_dtype, model_dtype),
        block_size=block_size,
        groups=kv_cache_groups(layer_windows) if layer_windows else (),
    )
