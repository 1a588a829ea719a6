"""The native library's argument structures, mirrored field for field from
csrc/attention/attention.h and csrc/layer/layer.h (same names, order and C types).  The library
reports its layouts (csrc/runtime/abi.c: sizes, each field's name and offset) and ops.Kernels
refuses a build whose layouts differ from these (`layout`).
"""

from __future__ import annotations

import ctypes

_P, _I32, _I64, _F32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float


class PagedDecodeArgs(ctypes.Structure):
    """csrc/attention/attention.h's paged_decode_args."""

    _fields_ = [
        ("query", _P),
        ("out", _P),
        ("key", _P),
        ("value", _P),
        ("key_scale", _P),
        ("value_scale", _P),
        ("lut", _P),
        ("block_tables", _P),
        ("seq_lens", _P),
        ("lse", _P),
        ("new_key", _P),
        ("new_value", _P),
        ("new_key_stride_bytes", _I64),
        ("new_value_stride_bytes", _I64),
        ("new_slots", _P),
        ("prior_out", _P),
        ("prior_lse", _P),
        ("kind", _I32),
        ("num_seqs", _I32),
        ("max_blocks", _I32),
        ("num_kv_heads", _I32),
        ("group", _I32),
        ("dim", _I32),
        ("block_size", _I32),
        ("sm_scale", _F32),
        ("num_threads", _I32),
        ("io_bf16", _I32),
        ("sliding_window", _I32),
        ("value_kind", _I32),
        ("key_sink", _P),
    ]


class PrefillArgs(ctypes.Structure):
    """csrc/attention/attention.h's prefill_attention_args."""

    _fields_ = [
        ("q", _P),
        ("k", _P),
        ("v", _P),
        ("q_stride", _I64),
        ("q_batch", _I64),
        ("k_stride", _I64),
        ("k_batch", _I64),
        ("v_stride", _I64),
        ("v_batch", _I64),
        ("num_seqs", _I64),
        ("num_query", _I64),
        ("num_keys", _I64),
        ("num_heads", _I32),
        ("num_kv_heads", _I32),
        ("dim", _I32),
        ("causal", _I32),
        ("scale", _F32),
        ("out_bf16", _P),
        ("out_f32", _P),
        ("lse", _P),
        ("engine", _I32),
        ("num_threads", _I32),
        ("kv_table", _P),
        ("table_stride", _I64),
        ("kv_block_size", _I64),
    ]


class DecodeLayer(ctypes.Structure):
    """csrc/layer/layer.h's decode_layer: one layer's weight pointers (oneDNN-packed
    projections) and shape."""

    _fields_ = [
        *(
            (name, _P)
            for name in ("input_norm", "qkv", "qkv_bias", "o", "post_norm", "gate_up", "down")
        ),
        ("hidden", _I64),
        ("intermediate", _I64),
        ("num_heads", _I32),
        ("num_kv_heads", _I32),
        ("head_dim", _I32),
        ("eps", _F32),
    ]


class DecodeStepArgs(ctypes.Structure):
    """csrc/layer/layer.h's decode_step_args."""

    _fields_ = [
        ("layers", _P),
        ("caches", _P),
        ("hidden", _P),
        ("cos", _P),
        ("sin", _P),
        ("q", _P),
        ("k", _P),
        ("qkv", _P),
        ("attn", _P),
        ("work", _P),
        ("block_tables", _P),
        ("seq_lens", _P),
        ("slots", _P),
        ("prefix_table", _P),
        ("prior_out", _P),
        ("prior_lse", _P),
        ("m", _I64),
        ("mp", _I64),
        ("num_layers", _I32),
        ("kind", _I32),
        ("max_blocks", _I32),
        ("block_size", _I32),
        ("prefix_blocks", _I32),
        ("sm_scale", _F32),
        ("threads", _I32),
    ]


class Q8Layer(ctypes.Structure):
    """csrc/layer/layer.h's q8_layer: one float32 layer's norms and 8- or 4-bit weights
    (models/quantized_linear.py's and q4_linear.py's layouts) and shape."""

    _fields_ = [
        *(
            (name, _P)
            for name in (
                "input_norm",
                "post_norm",
                "qkv_bias",
                "qkv",
                "o",
                "gate_up",
                "down",
                "qkv_scales",
                "o_scales",
                "gate_up_scales",
                "down_scales",
                "qkv_mins",
                "o_mins",
                "gate_up_mins",
                "down_mins",
            )
        ),  # fmt: skip
        ("hidden", _I64),
        ("intermediate", _I64),
        ("num_heads", _I32),
        ("num_kv_heads", _I32),
        ("head_dim", _I32),
        ("weight_bits", _I32),
        ("eps", _F32),
    ]


class Q8StepArgs(ctypes.Structure):
    """csrc/layer/layer.h's q8_step_args."""

    _fields_ = [
        *(
            (name, _P)
            for name in (
                "layers",
                "caches",
                "hidden",
                "cos",
                "sin",
                "work",
                "lut",
                "block_tables",
                "seq_lens",
                "slots",
            )
        ),  # fmt: skip
        ("m", _I64),
        ("num_layers", _I32),
        ("kind", _I32),
        ("max_blocks", _I32),
        ("block_size", _I32),
        ("sm_scale", _F32),
        ("threads", _I32),
    ]


# In runtime/abi.c's order: structure i there is STRUCTURES[i] here.
STRUCTURES = (PagedDecodeArgs, PrefillArgs, DecodeLayer, DecodeStepArgs, Q8Layer, Q8StepArgs)


def layout(structure: type[ctypes.Structure]) -> tuple[int, list[tuple[str, int]]]:
    """(size, [(field, offset), ...]) as ctypes lays the structure out: the C ABI's layout."""
    fields = [(name, getattr(structure, name).offset) for name, _ in structure._fields_]
    return ctypes.sizeof(structure), fields
