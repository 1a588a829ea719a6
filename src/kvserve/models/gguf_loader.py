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
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from kvserve.config import ModelConfig
from kvserve.models.loader import ModelLoadError, fuse_layer_weights, to_tensor
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


def _field(reader: GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Invert llama.cpp's permutation of q/k rows: (heads, 2, half) -> (heads, half, 2)."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def read_gguf_config(reader: GGUFReader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)} "
            f"(as Hugging Face: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )

    def need(key: str):
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks {arch}.{key}")
        return value

    num_heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // num_heads))
    vocab = _field(reader, f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(reader, arch),
        max_position_embeddings=int(need("context_length")),
        tie_word_embeddings=not has_output,
        attention_bias=any(t.name == "blk.0.attn_q.bias" for t in reader.tensors),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        torch_dtype="float32",
    )


def _rope_scaling(reader: GGUFReader, arch: str) -> dict | None:
    kind = _field(reader, f"{arch}.rope.scaling.type")
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    if kind in (None, "none") or not factor:
        return None
    if kind != "linear":
        raise ModelLoadError(f"unsupported GGUF RoPE scaling {kind!r}; supported: linear")
    return {"rope_type": "linear", "factor": float(factor)}


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
    try:
        reader = GGUFReader(str(path))
    except Exception as exc:  # the gguf package raises bare ValueErrors/asserts on junk
        raise ModelLoadError(f"{path} is not a readable GGUF file ({exc})") from None
    config = read_gguf_config(reader)
    tensors = {t.name: _dequantize(t) for t in reader.tensors}
    weights = fuse_layer_weights(config, _layers(config, tensors))
    weights["embed_tokens.weight"] = to_tensor(tensors["token_embd.weight"])
    weights["norm.weight"] = to_tensor(tensors["output_norm.weight"])
    if "output.weight" in tensors:
        weights["lm_head.weight"] = to_tensor(tensors["output.weight"])
    return config, weights
