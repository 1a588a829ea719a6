"""Read a model's shape from a preset, a config.json, a Hugging Face directory or a GGUF file.

Only metadata is read: the planner never loads weights (a GGUF file is memory-mapped just to
list its tensors' sizes).  The fields it shares with the model loader come from the one reader
per format in kvserve.formats; every missing or malformed field raises PlanError naming it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvserve.formats import FormatError, build
from kvserve.formats.hf_config import FieldReader, HFConfig, parse_hf_config, read_config_json
from kvserve.planner.model import LayerKind, ModelShape, PlanError, infer_layer_kinds
from kvserve.planner.presets import find_preset, preset_names


def load_model_shape(model: str) -> ModelShape:
    """MODEL|PRESET -> ModelShape: an existing path wins, then a preset name or HF id."""
    path = Path(model).expanduser()
    if path.is_dir():
        config = path / "config.json"
        if not config.is_file():
            raise PlanError(f"{model}: directory has no config.json")
        return read_hf_config(config)
    if path.is_file():
        return read_gguf(path) if path.suffix == ".gguf" else read_hf_config(path)
    preset = find_preset(model)
    if preset is not None:
        source = f"preset {preset.name}: {preset.hf_id} config.json"
        return shape_from_hf_config(preset.config, preset.title, source)
    if model.endswith((".gguf", ".json")):
        raise PlanError(f"no such file: {model}")
    raise PlanError(
        f"unknown preset {model!r} (and no such file or directory); "
        f"known presets: {', '.join(preset_names())}"
    )


def read_hf_config(path: Path) -> ModelShape:
    """A Hugging Face config.json file -> ModelShape."""
    try:
        config = read_config_json(path)
    except FormatError as exc:
        raise PlanError(str(exc)) from None
    name = config.get("_name_or_path") or path.resolve().parent.name or path.stem
    return shape_from_hf_config(config, str(name), f"{path}")


def shape_from_hf_config(config: Mapping[str, Any], name: str, source: str) -> ModelShape:
    """config.json fields -> ModelShape: the common ones from formats.hf_config (multimodal
    configs read from their text_config), the planner's extras from the same fields."""
    try:
        hf = parse_hf_config(config, source)
        field = FieldReader(hf.raw, source)
        return build(
            ModelShape,
            hf,
            name=name,
            torch_dtype=hf.torch_dtype or "bfloat16",  # what most checkpoints ship in
            weight_dtype=_quantized_weight_dtype(hf.raw),
            layer_kinds=_layer_kinds(hf, field),
            **_moe_fields(field),
            **_mla_fields(field),
        )
    except FormatError as exc:
        raise PlanError(str(exc)) from None


def _quantized_weight_dtype(config: Mapping[str, Any]) -> str | None:
    """The stored weight dtype of a quantized checkpoint (fp8, int8, int4), else None."""
    quant = config.get("quantization_config")
    if not isinstance(quant, Mapping):
        return None
    method = str(quant.get("quant_method", "")).lower()
    if method in ("fp8", "fbgemm_fp8"):
        return "fp8"
    bits = quant.get("bits") or quant.get("w_bit")
    if quant.get("load_in_4bit") or bits == 4:
        return "int4"
    if quant.get("load_in_8bit") or bits == 8:
        return "int8"
    return None


def _layer_kinds(hf: HFConfig, field: FieldReader) -> tuple[LayerKind, ...]:
    layer_types = hf.raw.get("layer_types")
    if layer_types is not None and (
        not isinstance(layer_types, list) or len(layer_types) != hf.num_layers
    ):
        raise PlanError(f"{field.source}: 'layer_types' must list one type per layer")
    return infer_layer_kinds(
        hf.model_type,
        hf.num_layers,
        hf.sliding_window,
        layer_types=layer_types,
        sliding_window_pattern=field.optional_int("sliding_window_pattern"),
        use_sliding_window=hf.use_sliding_window,
        max_window_layers=field.optional_int("max_window_layers"),
    )


def _moe_fields(field: FieldReader) -> dict[str, Any]:
    """Mixtral (num_local_experts), DeepSeek (n_routed_experts) and Qwen-MoE (num_experts)."""
    num_experts = (
        field.optional_int("num_local_experts")
        or field.optional_int("n_routed_experts")
        or field.optional_int("num_experts")
        or 0
    )
    if not num_experts:
        return {}
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": field.optional_int("num_experts_per_tok") or 0,
        "moe_intermediate_size": field.optional_int("moe_intermediate_size"),
        "num_shared_experts": field.optional_int("n_shared_experts") or 0,
        "first_k_dense_replace": field.optional_int("first_k_dense_replace") or 0,
    }


def _mla_fields(field: FieldReader) -> dict[str, Any]:
    """DeepSeek MLA: kv_lora_rank marks the model; qk_rope_head_dim is then required."""
    kv_lora_rank = field.optional_int("kv_lora_rank")
    if kv_lora_rank is None:
        return {}
    return {
        "kv_lora_rank": kv_lora_rank,
        "q_lora_rank": field.optional_int("q_lora_rank"),
        "qk_rope_head_dim": field.positive_int("qk_rope_head_dim", "the MLA RoPE key size"),
        "qk_nope_head_dim": field.optional_int("qk_nope_head_dim") or 0,
        "v_head_dim": field.optional_int("v_head_dim") or 0,
    }


def read_gguf(path: Path) -> ModelShape:
    """A GGUF file -> ModelShape, with exact parameter count and weight bytes from its tensors."""
    from kvserve.planner.gguf_meta import read_gguf_shape  # keeps `gguf` off the import path

    return read_gguf_shape(path)
