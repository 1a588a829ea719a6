"""Weight memory: parameter count (estimated from the shape) x bytes of the weight dtype.

The estimate counts the matrices every listed family has (embeddings, attention projections,
gated MLP or experts, norms) and ignores small extras (rotary buffers, per-family extra
norms).  It reproduces the published counts of Llama 2 exactly and of the MoE presets to
within 1%, which is far finer than the KV numbers need.
"""

from __future__ import annotations

import math

from kvserve.kv.spec import cdiv
from kvserve.planner.model import LayerKind, ModelShape, PlanError

# Bits per weight for --dtype; "auto" means the checkpoint's own dtype.
WEIGHT_DTYPE_BITS = {
    "float32": 32,
    "bfloat16": 16,
    "float16": 16,
    "fp8": 8,
    "int8": 8,
    "int4": 4,
}


def estimate_num_params(shape: ModelShape) -> int:
    """Parameter count of the model; the exact count when the source gave one."""
    if shape.num_params is not None:
        return shape.num_params
    embeddings = shape.vocab_size * shape.hidden_size
    lm_head = 0 if shape.tie_word_embeddings else embeddings
    layers = sum(_layer_params(shape, index, kind) for index, kind in enumerate(shape.kinds))
    return embeddings + lm_head + layers + shape.hidden_size  # + final norm


def _layer_params(shape: ModelShape, index: int, kind: LayerKind) -> int:
    """One decoder layer: attention (when it has one) + MLP + two norms."""
    attention = 0 if kind is LayerKind.NONE else _attention_params(shape)
    return attention + _mlp_params(shape, index) + 2 * shape.hidden_size


def _attention_params(shape: ModelShape) -> int:
    if shape.is_mla:
        return _mla_params(shape)
    hidden, q_dim = shape.hidden_size, shape.num_heads * shape.head_dim
    kv_dim = shape.num_kv_heads * shape.head_dim
    bias = q_dim + 2 * kv_dim if shape.attention_bias else 0
    return hidden * (q_dim + 2 * kv_dim) + q_dim * hidden + bias


def _mla_params(shape: ModelShape) -> int:
    """DeepSeek MLA: low-rank query, one shared K/V down-projection, per-head up-projection."""
    hidden, heads = shape.hidden_size, shape.num_heads
    qk_head = shape.qk_nope_head_dim + shape.qk_rope_head_dim
    if shape.q_lora_rank:
        query = hidden * shape.q_lora_rank + shape.q_lora_rank + shape.q_lora_rank * heads * qk_head
    else:
        query = hidden * heads * qk_head
    rank = shape.kv_lora_rank or 0
    kv_down = hidden * (rank + shape.qk_rope_head_dim) + rank
    kv_up = rank * heads * (shape.qk_nope_head_dim + shape.v_head_dim)
    out = heads * shape.v_head_dim * hidden
    return query + kv_down + kv_up + out


def _mlp_params(shape: ModelShape, index: int) -> int:
    """Gated MLP (gate, up, down), or routed + shared experts and the router."""
    hidden = shape.hidden_size
    if shape.num_experts == 0 or index < shape.first_k_dense_replace:
        return 3 * hidden * shape.intermediate_size
    expert = 3 * hidden * (shape.moe_intermediate_size or shape.intermediate_size)
    router = hidden * shape.num_experts
    return (shape.num_experts + shape.num_shared_experts) * expert + router


def resolve_weight_dtype(shape: ModelShape, dtype: str = "auto") -> str:
    """--dtype auto -> the checkpoint's weight dtype (its quantization, else torch_dtype)."""
    if dtype == "auto":
        return shape.weight_dtype or shape.torch_dtype
    if dtype not in WEIGHT_DTYPE_BITS:
        known = ", ".join(["auto", *WEIGHT_DTYPE_BITS])
        raise PlanError(f"--dtype must be one of {known}, got {dtype!r}")
    return dtype


def weight_bytes(shape: ModelShape, dtype: str = "auto") -> int:
    """Bytes of all weights; exact for a GGUF file read as stored, else params x dtype bytes."""
    if dtype == "auto" and shape.weight_bytes is not None:
        return shape.weight_bytes
    bits = WEIGHT_DTYPE_BITS.get(resolve_weight_dtype(shape, dtype))
    if bits is None:
        raise PlanError(f"{shape.name}: unknown weight dtype {shape.weight_dtype!r}")
    return math.ceil(estimate_num_params(shape) * bits / 8)


def weight_bytes_per_gpu(total_bytes: int, tensor_parallel_size: int) -> int:
    """Tensor parallelism splits every weight matrix (embeddings included) across the ranks."""
    return cdiv(total_bytes, tensor_parallel_size)
