"""GGUF loader: metadata -> ModelConfig, tensors dequantized with the `gguf` package.

llama.cpp's converter permutes the rows of attn_q / attn_k of the llama architecture so that
RoPE rotates adjacent pairs (GPT-J style); our model rotates halves (as Hugging Face does), so
those rows are permuted back here.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from kvserve.config import ModelConfig
from kvserve.formats import FormatError, build
from kvserve.formats.gguf_metadata import GGUFFields, open_gguf, read_gguf_metadata
from kvserve.models.checkpoint import fuse_layer_weights, to_tensor
from kvserve.models.converted_cache import load_converted
from kvserve.models.paths import ModelLoadError
from kvserve.models.registry import SUPPORTED_ARCHITECTURES

GGUF_ARCHITECTURES = ("llama", "qwen2")
SUPPORTED_TENSOR_TYPES = tuple(
    GGMLQuantizationType[name]
    for name in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K",
                 "Q6_K", "Q8_K", "Q2_K", "Q3_K")
)  # fmt: skip

_LAYER_PIECES = {
    "attn_q": "q",
    "attn_k": "k",
    "attn_v": "v",
    "attn_output": "o",
    "ffn_gate": "gate",
    "ffn_up": "up",
    "ffn_down": "down",
    "attn_norm": "input_norm",
    "ffn_norm": "post_norm",
}


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Invert llama.cpp's permutation of q/k rows: (heads, 2, half) -> (heads, half, 2)."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def read_gguf_config(fields: GGUFFields) -> ModelConfig:
    """ModelConfig from the metadata (formats.gguf_metadata); the engine needs the norm
    epsilon, the MLP width and the context length, which the planner can do without."""
    arch = fields.architecture()
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)} "
            f"(as Hugging Face: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    meta = read_gguf_metadata(fields)
    kind = (meta.rope_scaling or {}).get("rope_type", "linear")
    if kind != "linear":
        raise ModelLoadError(f"unsupported GGUF RoPE scaling {kind!r}; supported: linear")
    return build(
        ModelConfig,
        meta,
        intermediate_size=meta.need("intermediate_size"),
        rms_norm_eps=meta.need("rms_norm_eps"),
        max_position_embeddings=meta.need("max_position_embeddings"),
        torch_dtype="float32",  # every tensor is dequantized to float32 below
    )


def _dequantize(tensor) -> np.ndarray:
    if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES:
        names = ", ".join(t.name for t in SUPPORTED_TENSOR_TYPES)
        raise ModelLoadError(
            f"tensor {tensor.name} has unsupported type {tensor.tensor_type.name}; "
            f"supported: {names}"
        )
    array = dequantize(tensor.data, tensor.tensor_type)
    return array.reshape(tuple(int(d) for d in reversed(tensor.shape)))


def _layers(
    config: ModelConfig, tensors: dict[str, np.ndarray]
) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    permute = config.architecture == "llama"
    for i in range(config.num_layers):
        pieces: dict[str, torch.Tensor] = {}
        for gguf_name, piece in _LAYER_PIECES.items():
            for kind in ("weight", "bias"):
                array = tensors.get(f"blk.{i}.{gguf_name}.{kind}")
                if array is None:
                    continue
                if permute and piece == "q":
                    array = unpermute_qk(array, config.num_heads)
                elif permute and piece == "k":
                    array = unpermute_qk(array, config.num_kv_heads)
                pieces[f"{piece}.{kind}"] = to_tensor(array)
        if len(pieces) < len(_LAYER_PIECES):
            raise ModelLoadError(f"GGUF layer {i} is incomplete")
        yield i, pieces


def load_gguf(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The file's config and float32 weights, converted once per machine (converted_cache)."""
    return load_converted(path, convert_gguf)


def convert_gguf(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Metadata -> ModelConfig; tensors dequantized, q/k unpermuted, layer weights fused."""
    try:
        reader = open_gguf(path)
        config = read_gguf_config(GGUFFields(reader, str(path)))
    except FormatError as exc:
        raise ModelLoadError(str(exc)) from None
    tensors = {t.name: _dequantize(t) for t in reader.tensors}
    weights = fuse_layer_weights(config, _layers(config, tensors))
    weights["embed_tokens.weight"] = to_tensor(tensors["token_embd.weight"])
    weights["norm.weight"] = to_tensor(tensors["output_norm.weight"])
    if "output.weight" in tensors:
        weights["lm_head.weight"] = to_tensor(tensors["output.weight"])
    return config, weights
