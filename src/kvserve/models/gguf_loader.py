"""GGUF loader: metadata -> ModelConfig, tensors dequantized with the `gguf` package.

llama.cpp's converter permutes the rows of attn_q / attn_k of the llama architecture so that
RoPE rotates adjacent pairs (GPT-J style); our model rotates halves (as Hugging Face does), so
those rows are permuted back here.  qwen2, qwen3 and gemma3 keep Hugging Face's rows.

gemma3 (convert_hf_to_gguf.py's Gemma3Model): every norm weight is stored with Gemma's +1
already added (llama.cpp multiplies by it as by any RMSNorm weight); our parameters hold the
weights as Hugging Face stores them (GemmaRMSNorm scales by 1 + weight), so 1 is subtracted
here.  In float32 that is exact up to the 1 + w rounding the file already made, so the model
multiplies by the same float32 values as transformers does from the Hugging Face weights.  The
converter writes no local RoPE base, layer pattern or attention scale, which llama.cpp fixes
for the architecture; they are read where a newer converter writes them, else llama.cpp's
values: local RoPE base 10,000 (`gemma3.rope.freq_base_swa`), every sixth layer global
(`gemma3.attention.sliding_window_pattern`, an int or one bool per layer, true = sliding),
attention scale `gemma3.attention.scale`, else head_dim ** -0.5 (hidden / heads for the
62-layer 27B model, as llama.cpp).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from kvserve.config import ModelConfig
from kvserve.errors import UserInputError
from kvserve.formats import FormatError, build
from kvserve.formats.gguf_metadata import (
    DEFAULT_SLIDING_WINDOW_PATTERNS,
    GGUFFields,
    open_gguf,
    read_gguf_metadata,
)
from kvserve.models.checkpoint import fuse_layer_weights, to_tensor
from kvserve.models.converted_cache import load_converted
from kvserve.models.paths import ModelLoadError
from kvserve.models.registry import SUPPORTED_ARCHITECTURES

GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")
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
# Qwen3 and Gemma 3 add the q/k norms; Gemma 3's ffn_norm is its pre-MLP norm, and its
# post_attention_norm the attention output's.
_QK_NORM_PIECES = {"attn_q_norm": "q_norm", "attn_k_norm": "k_norm"}
_GEMMA3_PIECES = {
    **{name: piece for name, piece in _LAYER_PIECES.items() if name != "ffn_norm"},
    **_QK_NORM_PIECES,
    "post_attention_norm": "post_norm",
    "ffn_norm": "pre_ffn_norm",
    "post_ffw_norm": "post_ffn_norm",
}
GEMMA3_LOCAL_ROPE_BASE = 10_000.0  # llama.cpp's for gemma3


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
    window = int(meta.sliding_window or 0)
    own: dict = {
        "sliding_window": window,
        "layer_types": _layer_types(fields, arch, meta.num_layers) if window else (),
    }
    if arch == "qwen3":
        own["qk_norm"] = True
    if arch == "gemma3":
        own.update(_gemma3_config(meta.num_layers, meta.hidden_size, meta.num_heads,
                                  meta.head_dim, fields))  # fmt: skip
    try:
        return build(
            ModelConfig,
            meta,
            intermediate_size=meta.need("intermediate_size"),
            rms_norm_eps=meta.need("rms_norm_eps"),
            max_position_embeddings=meta.need("max_position_embeddings"),
            torch_dtype="float32",  # every tensor is dequantized to float32 below
            **own,
        )
    except FormatError:
        raise
    except UserInputError as exc:
        raise ModelLoadError(f"{fields.source}: {exc}") from None


def _layer_types(fields: GGUFFields, arch: str, num_layers: int) -> tuple[str, ...]:
    """Which layers slide: `{arch}.attention.sliding_window_pattern` where written (an int n:
    every n-th layer is global; a list: one bool per layer, true = sliding), else the one
    llama.cpp fixes for the architecture (gemma3: 6), else every layer."""
    key = f"{arch}.attention.sliding_window_pattern"
    pattern = fields.get(key)
    if pattern is None:
        pattern = DEFAULT_SLIDING_WINDOW_PATTERNS.get(arch)
    if pattern is None:
        sliding = [True] * num_layers
    elif isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise ModelLoadError(
                f"{fields.source}: '{key}' lists {len(pattern)} layers; the model has {num_layers}"
            )
        sliding = [bool(x) for x in pattern]
    else:
        sliding = [bool((i + 1) % int(pattern)) for i in range(num_layers)]
    return tuple("sliding_attention" if s else "full_attention" for s in sliding)


def _gemma3_config(
    num_layers: int, hidden: int, num_heads: int, head_dim: int, fields: GGUFFields
) -> dict:
    """What gemma3 adds to the common fields (see the module docstring for the defaults)."""
    local_base = fields.get("gemma3.rope.freq_base_swa") or GEMMA3_LOCAL_ROPE_BASE
    scale = fields.get("gemma3.attention.scale")
    if scale:  # the scale itself (float32): back to Hugging Face's integer scalar
        scalar = float(scale) ** -2
        scalar = float(round(scalar)) if abs(scalar - round(scalar)) < 1e-3 else scalar
    else:
        scalar = hidden / num_heads if num_layers == 62 else head_dim  # llama.cpp's 27B rule
    return {
        "qk_norm": True,
        "gemma_norms": True,
        "hidden_activation": "gelu_pytorch_tanh",
        "embedding_multiplier": hidden**0.5,
        "query_pre_attn_scalar": float(scalar),
        "rope_local_base_freq": float(local_base),
    }


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
    names = _LAYER_PIECES
    if config.architecture == "gemma3":
        names = _GEMMA3_PIECES
    elif config.qk_norm:
        names = {**_LAYER_PIECES, **_QK_NORM_PIECES}
    for i in range(config.num_layers):
        pieces: dict[str, torch.Tensor] = {}
        for gguf_name, piece in names.items():
            for kind in ("weight", "bias"):
                array = tensors.get(f"blk.{i}.{gguf_name}.{kind}")
                if array is None:
                    continue
                if permute and piece == "q":
                    array = unpermute_qk(array, config.num_heads)
                elif permute and piece == "k":
                    array = unpermute_qk(array, config.num_kv_heads)
                pieces[f"{piece}.{kind}"] = _gemma_norm(config, gguf_name, to_tensor(array))
        if len({name.split(".")[0] for name in pieces}) < len(names):
            raise ModelLoadError(f"GGUF layer {i} is incomplete")
        yield i, pieces


def _gemma_norm(config: ModelConfig, gguf_name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A gemma3 norm weight back to Hugging Face's form (the file's holds 1 + w)."""
    if config.architecture == "gemma3" and gguf_name.endswith("norm"):
        return tensor - 1.0
    return tensor


def stored_weight_type(tensors: Sequence) -> str:
    """The quantized type most of the layers' 2-D weights are stored in, "" where they are
    stored as floats (F32, F16, BF16)."""
    floats = {GGMLQuantizationType[name] for name in ("F32", "F16", "BF16")}
    kinds = Counter(
        t.tensor_type for t in tensors if t.name.startswith("blk.") and len(t.shape) == 2
    )
    quantized = [(count, kind.name) for kind, count in kinds.items() if kind not in floats]
    return max(quantized)[1] if quantized else ""


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
    config = replace(config, stored_weight_type=stored_weight_type(reader.tensors))
    tensors = {t.name: _dequantize(t) for t in reader.tensors}
    weights = fuse_layer_weights(config, _layers(config, tensors))
    weights["embed_tokens.weight"] = to_tensor(tensors["token_embd.weight"])
    output_norm = to_tensor(tensors["output_norm.weight"])
    weights["norm.weight"] = _gemma_norm(config, "output_norm", output_norm)
    if "output.weight" in tensors:
        weights["lm_head.weight"] = to_tensor(tensors["output.weight"])
    return config, weights
