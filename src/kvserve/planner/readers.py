"""Read a model's shape from a preset, a config.json, a Hugging Face directory or a GGUF file.

Only metadata is read: the planner never loads weights (a GGUF file is memory-mapped just to
list its tensors' sizes).  Every missing or malformed field raises PlanError naming it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvserve.planner.model import LayerKind, ModelShape, PlanError, infer_layer_kinds
from kvserve.planner.presets import find_preset, preset_names

MODEL_DTYPES = ("float32", "bfloat16", "float16")
_MISSING = object()


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
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PlanError(f"{path}: cannot read a JSON config ({exc})") from None
    if not isinstance(config, dict):
        raise PlanError(f"{path}: a config.json must hold a JSON object")
    name = config.get("_name_or_path") or path.resolve().parent.name or path.stem
    return shape_from_hf_config(config, str(name), f"{path}")


def shape_from_hf_config(config: Mapping[str, Any], name: str, source: str) -> ModelShape:
    """config.json fields -> ModelShape.  Multimodal configs are read from their text_config."""
    if "num_hidden_layers" not in config and isinstance(config.get("text_config"), Mapping):
        config = {**config["text_config"], "torch_dtype": _config_dtype(config)}
    field = _FieldReader(config, source)
    num_layers = field.positive_int("num_hidden_layers", "the number of layers")
    hidden = field.positive_int("hidden_size", "the model width")
    num_heads = field.positive_int("num_attention_heads", "the number of query heads")
    model_type = str(config.get("model_type", ""))
    return ModelShape(
        name=name,
        architecture=_architecture(config),
        num_layers=num_layers,
        hidden_size=hidden,
        intermediate_size=field.positive_int("intermediate_size", "the MLP width"),
        vocab_size=field.positive_int("vocab_size", "the vocabulary size"),
        num_heads=num_heads,
        num_kv_heads=field.positive_int("num_key_value_heads", "KV heads", default=num_heads),
        head_dim=field.positive_int("head_dim", "the head size", default=hidden // num_heads),
        torch_dtype=field.dtype(),
        weight_dtype=_quantized_weight_dtype(config),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=bool(config.get("attention_bias", model_type.startswith("qwen2"))),
        max_position_embeddings=field.optional_int("max_position_embeddings"),
        sliding_window=field.optional_int("sliding_window"),
        layer_kinds=_layer_kinds(config, model_type, num_layers, field),
        **_moe_fields(field),
        **_mla_fields(field),
        source=source,
    )


def _architecture(config: Mapping[str, Any]) -> str:
    architectures = config.get("architectures") or [config.get("model_type") or "unknown"]
    return str(architectures[0])


def _config_dtype(config: Mapping[str, Any]) -> Any:
    return config.get("torch_dtype") or config.get("dtype")


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


def _layer_kinds(
    config: Mapping[str, Any], model_type: str, num_layers: int, field: _FieldReader
) -> tuple[LayerKind, ...]:
    layer_types = config.get("layer_types")
    if layer_types is not None and (
        not isinstance(layer_types, list) or len(layer_types) != num_layers
    ):
        raise PlanError(f"{field.source}: 'layer_types' must list one type per layer")
    return infer_layer_kinds(
        model_type,
        num_layers,
        field.optional_int("sliding_window"),
        layer_types=layer_types,
        sliding_window_pattern=field.optional_int("sliding_window_pattern"),
        use_sliding_window=bool(config.get("use_sliding_window", True)),
        max_window_layers=field.optional_int("max_window_layers"),
    )


def _moe_fields(field: _FieldReader) -> dict[str, Any]:
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


def _mla_fields(field: _FieldReader) -> dict[str, Any]:
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


class _FieldReader:
    """Typed access to config.json fields with errors that name the field and the file."""

    def __init__(self, config: Mapping[str, Any], source: str) -> None:
        self.config = config
        self.source = source

    def positive_int(self, key: str, meaning: str, default: Any = _MISSING) -> int:
        value = self.config.get(key)
        if value is None:
            if default is _MISSING:
                raise PlanError(f"{self.source}: config has no '{key}' ({meaning})")
            value = default
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise PlanError(f"{self.source}: '{key}' must be a positive integer, got {value!r}")
        return value

    def optional_int(self, key: str) -> int | None:
        value = self.config.get(key)
        return None if value is None else self.positive_int(key, key)

    def dtype(self) -> str:
        value = _config_dtype(self.config) or "bfloat16"
        if value not in MODEL_DTYPES:
            raise PlanError(
                f"{self.source}: 'torch_dtype' is {value!r}; expected one of "
                f"{', '.join(MODEL_DTYPES)}"
            )
        return str(value)


def read_gguf(path: Path) -> ModelShape:
    """A GGUF file -> ModelShape, with exact parameter count and weight bytes from its tensors."""
    from kvserve.planner.gguf_meta import read_gguf_shape  # keeps `gguf` off the import path

    return read_gguf_shape(path)
