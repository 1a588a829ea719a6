"""Hugging Face directory loader: config.json + single or sharded *.safetensors."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from kvserve.config import ModelConfig
from kvserve.formats import FormatError
from kvserve.formats.hf_config import read_config_json
from kvserve.models.checkpoint import fuse_layer_weights, model_config_from_hf
from kvserve.models.paths import ModelLoadError

# HF suffix inside `model.layers.N.` -> the piece name fuse_layer_weights expects.
_LAYER_PIECES = {
    "self_attn.q_proj": "q",
    "self_attn.k_proj": "k",
    "self_attn.v_proj": "v",
    "self_attn.o_proj": "o",
    "mlp.gate_proj": "gate",
    "mlp.up_proj": "up",
    "mlp.down_proj": "down",
    "input_layernorm": "input_norm",
    "post_attention_layernorm": "post_norm",
    # Qwen3 and Gemma 3
    "self_attn.q_norm": "q_norm",
    "self_attn.k_norm": "k_norm",
    # Gemma 3 (its post_attention_layernorm normalizes the attention output)
    "pre_feedforward_layernorm": "pre_ffn_norm",
    "post_feedforward_layernorm": "post_ffn_norm",
}


def _read_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{directory} has no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key).to(torch.float32)
    return tensors


def _split_layers(
    config: ModelConfig, tensors: dict[str, torch.Tensor]
) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}."
        pieces: dict[str, torch.Tensor] = {}
        for hf_name, piece in _LAYER_PIECES.items():
            for kind in ("weight", "bias"):
                key = f"{prefix}{hf_name}.{kind}"
                if key in tensors:
                    pieces[f"{piece}.{kind}"] = tensors[key]
        missing = [
            p for p in ("q", "k", "v", "o", "gate", "up", "down") if p + ".weight" not in pieces
        ]
        if missing:
            raise ModelLoadError(f"layer {i} lacks weights for {', '.join(missing)}")
        yield i, pieces


def load_hf_directory(directory: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    path = directory / "config.json"
    try:
        raw = read_config_json(path)
    except FormatError as exc:
        raise ModelLoadError(str(exc)) from None
    config = model_config_from_hf(raw, str(path))
    tensors = _read_safetensors(directory)
    weights = fuse_layer_weights(config, _split_layers(config, tensors))
    weights["embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
    weights["norm.weight"] = tensors["model.norm.weight"]
    if not config.tie_word_embeddings:
        if "lm_head.weight" not in tensors:
            raise ModelLoadError("untied model without lm_head.weight")
        weights["lm_head.weight"] = tensors["lm_head.weight"]
    return config, weights
