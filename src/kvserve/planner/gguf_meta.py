"""GGUF metadata -> ModelShape: the fields shared with the model loader come from
kvserve.formats.gguf_metadata, the planner's extras (experts, MLA, layer kinds) from its keys.

The tensors are only listed, never read: their element counts and stored sizes give the
exact parameter count and weight bytes, which beats any estimate for a quantized file.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from kvserve.formats import FormatError, build
from kvserve.formats.gguf_metadata import (
    DEFAULT_SLIDING_WINDOW_PATTERNS,
    GGUFFields,
    GGUFMetadata,
    open_gguf,
    read_gguf_metadata,
)
from kvserve.planner.model import LayerKind, ModelShape, PlanError, infer_layer_kinds

# Tensor types that map to a torch dtype; every quantized type computes in float16.
_COMPUTE_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def read_gguf_shape(path: Path) -> ModelShape:
    """Read the shape fields of a GGUF file; PlanError naming the missing key."""
    try:
        fields = GGUFFields(open_gguf(path), str(path))
        return _shape(read_gguf_metadata(fields), fields, path)
    except FormatError as exc:
        raise PlanError(str(exc)) from None


def _shape(meta: GGUFMetadata, fields: GGUFFields, path: Path) -> ModelShape:
    """The common fields from formats.gguf_metadata; experts, MLA and sizes added here."""
    arch = meta.architecture
    tensors = fields.reader.tensors
    tensor_types = Counter({t.tensor_type.name: int(t.n_bytes) for t in tensors})
    dominant = max(tensor_types, key=tensor_types.__getitem__, default="F16")
    kv_lora_rank = fields.get(f"{arch}.attention.kv_lora_rank")
    rope_dim = fields.get(f"{arch}.rope.dimension_count") or 0
    return build(
        ModelShape,
        meta,
        name=meta.name or path.stem,
        intermediate_size=meta.intermediate_size or 0,
        torch_dtype=_COMPUTE_DTYPES.get(dominant, "float16"),
        weight_dtype=f"gguf {dominant}",
        layer_kinds=_layer_kinds(meta, fields),
        num_experts=fields.get(f"{arch}.expert_count") or 0,
        num_experts_per_tok=fields.get(f"{arch}.expert_used_count") or 0,
        kv_lora_rank=kv_lora_rank,
        q_lora_rank=fields.get(f"{arch}.attention.q_lora_rank"),
        qk_rope_head_dim=rope_dim if kv_lora_rank else 0,
        num_params=sum(int(t.n_elements) for t in tensors),
        weight_bytes=sum(int(t.n_bytes) for t in tensors),
    )


def _layer_kinds(meta: GGUFMetadata, fields: GGUFFields) -> tuple[LayerKind, ...]:
    """Per-layer KV head counts of 0 mark layers without attention (hybrid models)."""
    arch, num_layers = meta.architecture, meta.num_layers
    pattern = fields.get(f"{arch}.attention.sliding_window_pattern")
    if pattern is None:
        pattern = DEFAULT_SLIDING_WINDOW_PATTERNS.get(arch)
    # The pattern is a period (every n-th layer global) or one bool per layer (True: sliding).
    layer_types = None
    if isinstance(pattern, list):
        layer_types = ["sliding_attention" if slides else "full_attention" for slides in pattern]
        pattern = None
    kinds = infer_layer_kinds(
        arch,
        num_layers,
        meta.sliding_window,
        layer_types=layer_types,
        sliding_window_pattern=pattern,
    )
    kv_heads = meta.kv_heads_per_layer
    if kv_heads is not None and 0 in kv_heads:
        if len(kv_heads) != num_layers:
            raise PlanError(
                f"{meta.source}: {arch}.attention.head_count_kv has "
                f"{len(kv_heads)} entries for {num_layers} layers"
            )
        base = kinds or (LayerKind.FULL,) * num_layers
        kinds = tuple(LayerKind.NONE if n == 0 else k for n, k in zip(kv_heads, base, strict=True))
    return kinds
