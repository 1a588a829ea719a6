"""KV bytes for whole models whose layers differ: MLA, sliding-window and cache-less layers.

Standard attention (MHA / GQA / MQA) layers are counted by ``kvserve.kv.spec.kv_cache_spec``,
the function the engine sizes its cache with, so the planner and the engine agree to the
byte.  This module only groups layers and adds what that function does not model:

- MLA (DeepSeek): one compressed latent of ``kv_lora_rank`` values plus the shared RoPE key of
  ``qk_rope_head_dim`` values per token and layer.  No head factor, no K/V factor 2, and every
  tensor-parallel rank keeps the whole latent (it is not split by heads).  For 8-bit dtypes
  that carry scales the latent is one "head": one float32 scale per token and layer.
- sliding-window layers keep only the last ``window`` tokens of a sequence.
- layers without attention keep nothing.

Two ways of counting a sequence, both needed:

    bytes_per_sequence(n)        token-exact, the article formula (tokens x bytes per token)
    block_bytes_per_sequence(n)  whole blocks, what a paged engine actually allocates
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from kvserve.config import SPLIT_KV_DTYPES, key_value_dtypes
from kvserve.kv.spec import (
    DTYPE_BITS,
    SCALE_BYTES_PER_TOKEN_HEAD,
    blocks_kept,
    cdiv,
    kv_cache_spec,
    kv_heads_per_rank,
    resolve_kv_dtype,
    row_bytes,
)
from kvserve.planner.model import LayerKind, ModelShape, PlanError


@dataclass(frozen=True)
class LayerGroup:
    """Layers that store the same bytes per token and keep the same tokens of a sequence."""

    label: str  # "global", "sliding 4096", ...
    num_layers: int
    bytes_per_token: int  # all layers of the group together, on one rank
    window: int | None  # tokens kept per sequence; None: all of them
    block_size: int

    def num_tokens_kept(self, num_tokens: int) -> int:
        return num_tokens if self.window is None else min(num_tokens, self.window)

    def num_blocks_kept(self, num_tokens: int) -> int:
        """Blocks a sequence of ``num_tokens`` holds in this group: the engine's count
        (kv/spec.py blocks_kept: a window straddles ceil((W - 1) / block_size) + 1 blocks)."""
        return blocks_kept(self.window or 0, num_tokens, self.block_size)


@dataclass(frozen=True)
class KVLayout:
    """The KV cache of one model on one tensor-parallel rank, for one KV dtype."""

    groups: tuple[LayerGroup, ...]  # only groups that store KV
    num_layers_without_kv: int
    dtype: str  # resolved storage dtype, e.g. "bfloat16", "fp8_e4m3"
    block_size: int
    formula: tuple[str, ...]  # human-readable, one line per part

    @property
    def bytes_per_token(self) -> int:
        """Bytes one more token costs while no window is full yet (all KV layers)."""
        return sum(group.bytes_per_token for group in self.groups)

    @property
    def bytes_per_block(self) -> int:
        """A block of ``block_size`` tokens in every KV layer (the engine's unit)."""
        return self.block_size * self.bytes_per_token

    @property
    def is_uniform(self) -> bool:
        """True when every KV layer keeps every token (no windows)."""
        return all(group.window is None for group in self.groups)

    def bytes_per_sequence(self, num_tokens: int) -> int:
        """Token-exact KV bytes of one sequence of ``num_tokens`` tokens, windows applied."""
        return sum(g.bytes_per_token * g.num_tokens_kept(num_tokens) for g in self.groups)

    def block_bytes_per_sequence(self, num_tokens: int) -> int:
        """KV bytes of one sequence counted in whole blocks, as a paged engine allocates."""
        return sum(
            g.bytes_per_token * g.block_size * g.num_blocks_kept(num_tokens) for g in self.groups
        )

    def max_num_seqs(self, budget_bytes: int, num_tokens: int) -> int:
        """Sequences of ``num_tokens`` tokens that fit in ``budget_bytes`` at the same time.

        For a uniform model this equals (budget // bytes_per_block) // blocks per sequence,
        the engine's own count.
        """
        return max(0, budget_bytes) // self.block_bytes_per_sequence(max(1, num_tokens))

    def max_model_len(self, budget_bytes: int) -> int | None:
        """Longest single sequence (a multiple of block_size) that fits; None: no limit.

        No limit happens when every KV layer slides: memory stops growing once the windows
        are full.
        """
        blocks_hi = self._search_limit_blocks(budget_bytes)
        if blocks_hi is None:
            return None
        lo, hi = 0, blocks_hi  # invariant: lo blocks fit; hi + 1 blocks do not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.block_bytes_per_sequence(mid * self.block_size) <= budget_bytes:
                lo = mid
            else:
                hi = mid - 1
        return lo * self.block_size

    def _search_limit_blocks(self, budget_bytes: int) -> int | None:
        """An upper bound on the blocks one sequence can use, or None when unbounded."""
        growing = sum(g.bytes_per_token for g in self.groups if g.window is None)
        if growing:
            return max(0, budget_bytes) // (growing * self.block_size) + 1
        widest = max(g.window or 0 for g in self.groups) + self.block_size
        if self.block_bytes_per_sequence(widest) <= budget_bytes:
            return None
        return cdiv(widest, self.block_size)


def kv_layout(
    shape: ModelShape,
    kv_cache_dtype: str,
    block_size: int,
    tensor_parallel_size: int = 1,
) -> KVLayout:
    """Group the model's layers by what they cache and count each group's bytes per token."""
    dtype = resolve_kv_dtype(kv_cache_dtype, shape.torch_dtype)
    counts = Counter(shape.kinds)
    groups = []
    for kind in (LayerKind.FULL, LayerKind.SLIDING):
        if counts[kind]:
            groups.append(
                _group(shape, kind, counts[kind], kv_cache_dtype, block_size, tensor_parallel_size)
            )
    if not groups:
        raise PlanError(f"{shape.name}: no layer keeps a KV cache; nothing to plan")
    num_none = counts[LayerKind.NONE]
    formula = _formula(shape, dtype, tuple(groups), num_none, tensor_parallel_size)
    return KVLayout(tuple(groups), num_none, dtype, block_size, formula)


def _group(
    shape: ModelShape,
    kind: LayerKind,
    num_layers: int,
    kv_cache_dtype: str,
    block_size: int,
    tensor_parallel_size: int,
) -> LayerGroup:
    if shape.is_mla:
        dtype = resolve_kv_dtype(kv_cache_dtype, shape.torch_dtype)
        per_token = num_layers * mla_bytes_per_token_per_layer(shape, dtype)
    else:
        spec = kv_cache_spec(
            num_layers=num_layers,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            kv_cache_dtype=kv_cache_dtype,
            model_dtype=shape.torch_dtype,
            block_size=block_size,
            tensor_parallel_size=tensor_parallel_size,
        )
        per_token = spec.bytes_per_token
    if kind is LayerKind.SLIDING:
        label, window = f"sliding {shape.sliding_window}", shape.sliding_window
    else:
        label, window = "global", None
    return LayerGroup(label, num_layers, per_token, window, block_size)


def mla_bytes_per_token_per_layer(shape: ModelShape, dtype: str) -> int:
    """(kv_lora_rank + qk_rope_head_dim) values, plus one scale for dtypes that carry scales."""
    latent = (shape.kv_lora_rank or 0) + shape.qk_rope_head_dim
    return row_bytes(latent, key_value_dtypes(dtype)[0])  # the latent is a key


def _formula(
    shape: ModelShape,
    dtype: str,
    groups: tuple[LayerGroup, ...],
    num_none: int,
    tensor_parallel_size: int,
) -> tuple[str, ...]:
    """Say which formula produced the numbers, with this model's values filled in."""
    num_kv_layers = sum(g.num_layers for g in groups)
    if dtype in SPLIT_KV_DTYPES:
        return _split_formula(shape, dtype, num_kv_layers, tensor_parallel_size)
    value = f"{DTYPE_BITS[dtype] / 8:g} B ({dtype})"
    scale = SCALE_BYTES_PER_TOKEN_HEAD.get(dtype, 0)
    if shape.is_mla:
        lines = [
            f"MLA: {num_kv_layers} layers x ({shape.kv_lora_rank} kv_lora_rank + "
            f"{shape.qk_rope_head_dim} qk_rope_head_dim) x {value}"
            + (f" + {scale} B scale per layer" if scale else ""),
            "one latent per token: no K/V factor 2, no head factor, whole on every TP rank",
        ]
    else:
        heads = kv_heads_per_rank(shape.num_kv_heads, tensor_parallel_size)
        lines = [
            f"{shape.attention_name}: 2 (K,V) x {num_kv_layers} layers x {heads} KV heads x "
            f"{shape.head_dim} head_dim x {value}"
            + (f" + 2 x {scale} B scales per KV head" if scale else ""),
            _heads_line(shape, tensor_parallel_size, heads),
        ]
    lines += [
        f"{g.num_layers} sliding layers keep only the last {g.window} tokens"
        for g in groups
        if g.window is not None
    ]
    if num_none:
        lines.append(f"{num_none} layers have no attention and keep no KV cache")
    return tuple(line for line in lines if line)


def _split_formula(
    shape: ModelShape, dtype: str, num_kv_layers: int, tensor_parallel_size: int
) -> tuple[str, ...]:
    """The formula of a dtype that stores keys and values in two formats (k8v4)."""
    heads = kv_heads_per_rank(shape.num_kv_heads, tensor_parallel_size)
    key, value = key_value_dtypes(dtype)
    parts = " + ".join(
        f"{shape.head_dim} x {DTYPE_BITS[name] / 8:g} B ({name} {which})"
        + (f" + {SCALE_BYTES_PER_TOKEN_HEAD.get(name, 0)} B scale")
        for which, name in (("K", key), ("V", value))
    )
    return (
        f"{shape.attention_name}: {num_kv_layers} layers x {heads} KV heads x ({parts})",
        _heads_line(shape, tensor_parallel_size, heads),
    )


def _heads_line(shape: ModelShape, tensor_parallel_size: int, heads_per_rank: int) -> str:
    """How KV heads land on ranks: split, or replicated when there are fewer than ranks."""
    if tensor_parallel_size == 1:
        return f"{shape.num_heads} query heads share {shape.num_kv_heads} KV heads"
    if shape.num_kv_heads < tensor_parallel_size:
        copies = tensor_parallel_size // shape.num_kv_heads
        return (
            f"{shape.num_kv_heads} KV heads < TP {tensor_parallel_size}: each rank keeps 1 head,"
            f" every head replicated on {copies} ranks"
        )
    return (
        f"{shape.num_kv_heads} KV heads split over TP {tensor_parallel_size}: "
        f"{heads_per_rank} per rank"
    )
