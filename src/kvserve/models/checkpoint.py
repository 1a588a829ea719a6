"""What a loaded checkpoint is, and the pieces both loaders (hf_loader.py, gguf_loader.py)
build one from: a ModelConfig from config.json fields, HF-named layer weights fused under our
parameter names, float32 tensors.  Apart from loader.py, which dispatches to the two loaders,
so that neither loader imports the module that imports it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvserve.config import LAYER_TYPES, ModelConfig
from kvserve.errors import UserInputError
from kvserve.formats import FormatError, build
from kvserve.formats.hf_config import FieldReader, HFConfig, architecture_of, parse_hf_config
from kvserve.models.paths import ModelLoadError
from kvserve.models.registry import SUPPORTED_ARCHITECTURES, normalize_architecture


@dataclass
class Checkpoint:
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # our names -> float32 tensors
    path: Path  # the file or directory it came from (also holds the tokenizer)
    name: str  # a short name to serve the model under


def model_config_from_hf(cfg: Mapping[str, Any], source: str = "config.json") -> ModelConfig:
    """ModelConfig from a Hugging Face config.json dictionary, read by formats.hf_config."""
    arch = _supported_architecture(architecture_of(cfg))
    try:
        hf = parse_hf_config(cfg, source)
    except FormatError as exc:
        raise ModelLoadError(str(exc)) from None
    field = FieldReader(hf.raw, source)
    try:
        own = _gemma3_fields(hf, field) if arch == "gemma3" else _windows(hf, field)
        if arch == "qwen3":
            own["qk_norm"] = True
        own.setdefault("max_position_embeddings", hf.max_position_embeddings or 2048)
        return build(
            ModelConfig, hf, architecture=arch, torch_dtype=hf.torch_dtype or "float32", **own
        )
    except FormatError as exc:
        raise ModelLoadError(str(exc)) from None
    except UserInputError as exc:
        raise ModelLoadError(f"{source}: {exc}") from None


def _windows(hf: HFConfig, field: FieldReader) -> dict[str, Any]:
    """sliding_window and layer_types: each layer attends over the last `sliding_window`
    positions where its type is sliding_attention.  The config's layer_types where it lists
    them; else Qwen2 / Qwen3 slide from layer max_window_layers on (transformers' rule), and
    Mistral's every layer."""
    window = hf.effective_sliding_window or 0
    if not window:
        return {"sliding_window": 0, "layer_types": ()}
    types = _layer_types(field, hf.num_layers)
    if types is None and hf.model_type.lower().startswith(("qwen2", "qwen3")):
        first = field.config.get("max_window_layers", 28)
        types = tuple(
            "sliding_attention" if i >= first else "full_attention" for i in range(hf.num_layers)
        )
    return {"sliding_window": window, "layer_types": types or ()}


def _layer_types(field: FieldReader, num_layers: int) -> tuple[str, ...] | None:
    """The config's layer_types (one of LAYER_TYPES per layer), or None where it has none."""
    value = field.config.get("layer_types")
    if value is None:
        return None
    if not isinstance(value, list) or any(t not in LAYER_TYPES for t in value):
        raise FormatError(
            f"{field.source}: 'layer_types' must list one of {', '.join(LAYER_TYPES)} per "
            f"layer, got {value!r}"
        )
    if len(value) != num_layers:
        raise FormatError(
            f"{field.source}: 'layer_types' lists {len(value)} layers; num_hidden_layers is "
            f"{num_layers}"
        )
    return tuple(value)


def _gemma3_fields(hf: HFConfig, field: FieldReader) -> dict[str, Any]:
    """Gemma 3 (text): what its config class adds to the common fields, with transformers'
    defaults (Gemma3TextConfig) where the config omits a field."""
    raw, source = field.config, field.source
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if raw.get(key) is not None:
            raise ModelLoadError(f"{source}: '{key}' is {raw[key]!r}; logit soft-capping is "
                                 "not supported (Gemma 3 sets it null)")  # fmt: skip
    if raw.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{source}: 'use_bidirectional_attention' is not supported")
    if hf.attention_bias:
        raise ModelLoadError(f"{source}: Gemma 3 with 'attention_bias' is not supported")
    activation = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if activation != "gelu_pytorch_tanh":
        raise ModelLoadError(
            f"{source}: Gemma 3's hidden_activation {activation!r} is not supported; "
            "supported: gelu_pytorch_tanh"
        )
    num_layers = hf.num_layers
    types = _layer_types(field, num_layers)
    if types is None:
        pattern = raw.get("sliding_window_pattern", raw.get("_sliding_window_pattern")) or 6
        types = tuple(
            "sliding_attention" if (i + 1) % int(pattern) else "full_attention"
            for i in range(num_layers)
        )
    window = field.optional_int("sliding_window")
    window = 4096 if window is None and "sliding_window" not in raw else window or 0
    return {
        "sliding_window": window,
        "layer_types": types,
        "qk_norm": True,
        "gemma_norms": True,
        "hidden_activation": activation,
        "embedding_multiplier": hf.hidden_size**0.5,
        "query_pre_attn_scalar": float(raw.get("query_pre_attn_scalar") or 256),
        "head_dim": field.positive_int("head_dim", "the head size", default=256),
        "tie_word_embeddings": bool(field.optional_bool("tie_word_embeddings", True)),
        "max_position_embeddings": hf.max_position_embeddings or 131072,
        **_gemma3_rope(field),
    }


def _gemma3_rope(field: FieldReader) -> dict[str, Any]:
    """The global layers' RoPE (rope_theta, rope_scaling) and the local ones' base: from
    transformers 5's per-layer-type rope_parameters, or the older rope_theta, rope_scaling and
    rope_local_base_freq; Gemma3TextConfig's defaults 1e6 and 1e4."""
    raw, source = field.config, field.source
    params = field.mapping("rope_parameters") or {}
    full = params.get("full_attention")
    if isinstance(full, Mapping) or isinstance(params.get("sliding_attention"), Mapping):
        full, local = dict(full or {}), dict(params.get("sliding_attention") or {})
    else:  # the older fields (a flat rope_parameters: the global layers')
        full = {**params, **(field.mapping("rope_scaling") or {})}
        local = {"rope_theta": raw.get("rope_local_base_freq")}
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise ModelLoadError(
            f"{source}: Gemma 3's sliding layers' RoPE must be the default one, got {local!r}"
        )
    theta = float(full.get("rope_theta") or raw.get("rope_theta") or 1_000_000.0)
    local_theta = float(local.get("rope_theta") or raw.get("rope_local_base_freq") or 10_000.0)
    kind = full.get("rope_type", full.get("type", "default"))
    scaling = None if kind == "default" else {k: v for k, v in full.items() if k != "rope_theta"}
    return {"rope_theta": theta, "rope_scaling": scaling, "rope_local_base_freq": local_theta}


def _supported_architecture(name: str) -> str:
    """Our family name for an architecture as written; ModelLoadError listing ours otherwise."""
    arch = normalize_architecture(name)
    if arch is None:
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        raise ModelLoadError(f"unsupported architecture {name!r}; supported: {supported}")
    return arch


# The pieces some architectures add (Qwen3 and Gemma 3 the q/k norms, Gemma the two MLP
# norms) -> our parameter names inside `layers.N.`.
_EXTRA_PIECES = {
    "q_norm": "q_norm",
    "k_norm": "k_norm",
    "pre_ffn_norm": "pre_feedforward_layernorm",
    "post_ffn_norm": "post_feedforward_layernorm",
}


def extra_pieces(config: ModelConfig) -> tuple[str, ...]:
    """The pieces of _EXTRA_PIECES every layer of this model has."""
    return (("q_norm", "k_norm") if config.qk_norm else ()) + (
        ("pre_ffn_norm", "post_ffn_norm") if config.gemma_norms else ()
    )


def fuse_layer_weights(
    config: ModelConfig, per_layer: Iterator[tuple[int, dict[str, torch.Tensor]]]
) -> dict[str, torch.Tensor]:
    """Fuse q/k/v and gate/up per layer into our names; `per_layer` yields HF-named pieces."""
    out: dict[str, torch.Tensor] = {}
    extras = extra_pieces(config)
    for i, p in per_layer:
        prefix = f"layers.{i}."
        missing = [piece for piece in extras if piece + ".weight" not in p]
        if missing:
            raise ModelLoadError(f"layer {i} lacks weights for {', '.join(missing)}")
        for piece in extras:
            out[prefix + _EXTRA_PIECES[piece] + ".weight"] = p[piece + ".weight"]
        out[prefix + "qkv_proj.weight"] = torch.cat([p["q.weight"], p["k.weight"], p["v.weight"]])
        if config.attention_bias:
            out[prefix + "qkv_proj.bias"] = torch.cat([p["q.bias"], p["k.bias"], p["v.bias"]])
        out[prefix + "o_proj.weight"] = p["o.weight"]
        out[prefix + "gate_up_proj.weight"] = torch.cat([p["gate.weight"], p["up.weight"]])
        out[prefix + "down_proj.weight"] = p["down.weight"]
        out[prefix + "input_layernorm.weight"] = p["input_norm.weight"]
        out[prefix + "post_attention_layernorm.weight"] = p["post_norm.weight"]
    return out


def to_tensor(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(array, dtype=np.float32, copy=True, order="C"))
