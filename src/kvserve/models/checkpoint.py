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

from kvserve.config import ModelConfig
from kvserve.formats import FormatError, build
from kvserve.formats.hf_config import architecture_of, parse_hf_config
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
    max_len = hf.max_position_embeddings or 2048
    window = hf.effective_sliding_window
    if window and window < max_len:
        max_len = window  # full attention is exact while a sequence fits in the window
    return build(
        ModelConfig,
        hf,
        architecture=arch,
        max_position_embeddings=max_len,
        torch_dtype=hf.torch_dtype or "float32",
    )


def _supported_architecture(name: str) -> str:
    """Our family name for an architecture as written; ModelLoadError listing ours otherwise."""
    arch = normalize_architecture(name)
    if arch is None:
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        raise ModelLoadError(f"unsupported architecture {name!r}; supported: {supported}")
    return arch


def fuse_layer_weights(
    config: ModelConfig, per_layer: Iterator[tuple[int, dict[str, torch.Tensor]]]
) -> dict[str, torch.Tensor]:
    """Fuse q/k/v and gate/up per layer into our names; `per_layer` yields HF-named pieces."""
    out: dict[str, torch.Tensor] = {}
    for i, p in per_layer:
        prefix = f"layers.{i}."
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
