"""GGUF metadata -> ModelShape, using the llama.cpp key names (``{arch}.block_count``...).

The tensors are only listed, never read: their element counts and stored sizes give the
exact parameter count and weight bytes, which beats any estimate for a quantized file.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from kvserve.planner.model import LayerKind, ModelShape, PlanError, infer_layer_kinds

# Tensor types that map to a torch dtype; every quantized type computes in float16.
_COMPUTE_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def read_gguf_shape(path: Path) -> ModelShape:
    """Read the shape fields of a GGUF file; PlanError naming the missing key."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception as exc:  # the gguf package raises many types for a malformed file
        raise PlanError(f"{path}: not a readable GGUF file ({exc})") from None
    meta = _Metadata(reader, str(path))
    arch = meta.get("general.architecture")
    if not arch:
        raise PlanError(f"{path}: GGUF has no 'general.architecture'")
    return _shape(meta, str(arch), reader, path)


def _shape(meta: _Metadata, arch: str, reader: Any, path: Path) -> ModelShape:
    num_layers = meta.require_int(f"{arch}.block_count")
    hidden = meta.require_int(f"{arch}.embedding_length")
    num_heads = _first_nonzero(meta.require(f"{arch}.attention.head_count"))
    kv_heads = meta.get(f"{arch}.attention.head_count_kv", num_heads)
    tensor_types = Counter({t.tensor_type.name: int(t.n_bytes) for t in reader.tensors})
    dominant = max(tensor_types, key=tensor_types.__getitem__, default="F16")
    kv_lora_rank = meta.get(f"{arch}.attention.kv_lora_rank")
    rope_dim = meta.get(f"{arch}.rope.dimension_count") or 0
    key_length = meta.get(f"{arch}.attention.key_length") or hidden // num_heads
    return ModelShape(
        name=str(meta.get("general.name") or path.stem),
        architecture=arch,
        num_layers=num_layers,
        hidden_size=hidden,
        intermediate_size=_first_nonzero(meta.get(f"{arch}.feed_forward_length", 0)),
        vocab_size=_vocab_size(meta, arch, reader),
        num_heads=num_heads,
        num_kv_heads=_first_nonzero(kv_heads),
        head_dim=key_length,
        torch_dtype=_COMPUTE_DTYPES.get(dominant, "float16"),
        weight_dtype=f"gguf {dominant}",
        max_position_embeddings=meta.get(f"{arch}.context_length"),
        sliding_window=meta.get(f"{arch}.attention.sliding_window"),
        layer_kinds=_layer_kinds(meta, arch, num_layers, kv_heads),
        num_experts=meta.get(f"{arch}.expert_count") or 0,
        num_experts_per_tok=meta.get(f"{arch}.expert_used_count") or 0,
        kv_lora_rank=kv_lora_rank,
        q_lora_rank=meta.get(f"{arch}.attention.q_lora_rank"),
        qk_rope_head_dim=rope_dim if kv_lora_rank else 0,
        num_params=sum(int(t.n_elements) for t in reader.tensors),
        weight_bytes=sum(int(t.n_bytes) for t in reader.tensors),
        source=str(path),
    )


def _layer_kinds(
    meta: _Metadata, arch: str, num_layers: int, kv_heads: Any
) -> tuple[LayerKind, ...]:
    """Per-layer KV head counts of 0 mark layers without attention (hybrid models)."""
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
    # The pattern is a period (every n-th layer global) or one bool per layer (True: sliding).
    layer_types = None
    if isinstance(pattern, list):
        layer_types = ["sliding_attention" if slides else "full_attention" for slides in pattern]
        pattern = None
    kinds = infer_layer_kinds(
        arch,
        num_layers,
        meta.get(f"{arch}.attention.sliding_window"),
        layer_types=layer_types,
        sliding_window_pattern=pattern,
    )
    if isinstance(kv_heads, list) and 0 in kv_heads:
        if len(kv_heads) != num_layers:
            raise PlanError(
                f"{meta.source}: {arch}.attention.head_count_kv has "
                f"{len(kv_heads)} entries for {num_layers} layers"
            )
        base = kinds or (LayerKind.FULL,) * num_layers
        kinds = tuple(LayerKind.NONE if n == 0 else k for n, k in zip(kv_heads, base, strict=True))
    return kinds


def _vocab_size(meta: _Metadata, arch: str, reader: Any) -> int:
    vocab = meta.get(f"{arch}.vocab_size")
    if vocab:
        return int(vocab)
    tokens = reader.get_field("tokenizer.ggml.tokens")
    if tokens is not None:
        return len(tokens.data)
    for tensor in reader.tensors:
        if tensor.name == "token_embd.weight":
            return int(max(tensor.shape))
    raise PlanError(f"{meta.source}: GGUF has no vocabulary size ({arch}.vocab_size)")


def _first_nonzero(value: Any) -> int:
    """Per-layer arrays (hybrid models) -> the value of the layers that have one."""
    if isinstance(value, list):
        value = next((v for v in value if v), 0)
    return int(value)


class _Metadata:
    """GGUF key/value access with errors that name the missing key."""

    def __init__(self, reader: Any, source: str) -> None:
        self.reader = reader
        self.source = source

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.get_field(key)
        if field is None:
            return default
        return field.contents()

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise PlanError(f"{self.source}: GGUF has no '{key}'")
        return value

    def require_int(self, key: str) -> int:
        value = self.require(key)
        if not isinstance(value, int) or value <= 0:
            raise PlanError(f"{self.source}: '{key}' must be a positive integer, got {value!r}")
        return value
