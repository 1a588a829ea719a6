"""A float32 model's decode steps over 8-bit (or 4-bit: q4_linear.py) weights in one C call
(native/csrc/layer/decode_step_q8.c): every layer, attention included.

A one-row decode step of the embedded model through the compiled layers made 121 projection
calls and 30 attention calls from Python, each ~20-40 us above its kernel: about half of a
~24 ms step on the AMD EPYC (AVX2, so float32), whose 8-bit weights take ~8 ms to read.  This
is the float32 counterpart of NativeLayers.run_step (bfloat16 models on AVX512-BF16 CPUs),
for decode-only steps of up to the weights' kernel rows (8), where the projections take the
8- or 4-bit kernel anyway; every other step keeps the per-layer path.  Its values agree with the
per-layer path's to float32 rounding (docs/decisions/q8-decode-step.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.profiler import record_function

from kvserve.attention.base import DecodeStepPlan
from kvserve.models.native_layers import PROFILE_RANGE
from kvserve.models.q4_linear import Q4Linear
from kvserve.models.quantized_linear import Q8Linear
from kvserve.native import ops
from kvserve.native.structs import Q8Layer


def _describe(layer: nn.Module) -> Q8Layer:
    """The C description of one DecoderLayer (its tensors must outlive it: the layer's own)."""
    qkv, o, gate_up, down = layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj
    named = (("qkv", qkv), ("o", o), ("gate_up", gate_up), ("down", down))
    four = isinstance(qkv, Q4Linear)
    return Q8Layer(
        input_norm=layer.input_layernorm.weight.data_ptr(),
        post_norm=layer.post_attention_layernorm.weight.data_ptr(),
        qkv_bias=None if qkv.bias is None else qkv.bias.data_ptr(),
        **{name: p.codes.data_ptr() for name, p in named},
        **{f"{name}_scales": p.scales.data_ptr() for name, p in named},
        **{f"{name}_mins": p.mins.data_ptr() if four else None for name, p in named},
        weight_bits=4 if four else 8,
        hidden=o.out_features,
        intermediate=gate_up.out_features // 2,
        num_heads=layer.num_heads,
        num_kv_heads=layer.num_kv_heads,
        head_dim=layer.head_dim,
        eps=layer.input_layernorm.eps,
    )  # fmt: skip


def _takes(layer: nn.Module) -> bool:
    """A plain Llama layer (no q/k norms, Gemma norms or windows) in float32 whose projections
    are all 8-bit (Q8Linear) or all 4-bit (Q4Linear), without biases past the QKV
    projection."""
    projections = (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
    if not getattr(layer, "is_plain", False) or layer.sliding_window:
        return False
    if not any(all(isinstance(p, kind) for p in projections) for kind in (Q8Linear, Q4Linear)):
        return False
    if any(p.bias is not None for p in projections[1:]):
        return False
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if any(n.weight.dtype != torch.float32 or not n.weight.is_contiguous() for n in norms):
        return False
    return layer.input_layernorm.eps == layer.post_attention_layernorm.eps


class Q8DecodeStep:
    """Decode-only steps of up to `max_rows` rows, every layer in one C call."""

    def __init__(self, layers: Sequence[nn.Module], kernels: ops.Kernels) -> None:
        self._kernels = kernels
        self._layers = kernels.q8_layers([_describe(layer) for layer in layers])
        self.max_rows = min(layer.qkv_proj.kernel_rows for layer in layers)

    @classmethod
    def build(cls, layers: Sequence[nn.Module]) -> Q8DecodeStep | None:
        """For these layers, or None where the C step cannot run them (no native library,
        layers not 8- or 4-bit float32 ones of one shape)."""
        if not layers or not all(_takes(layer) for layer in layers):
            return None
        shapes = {(x.o_proj.out_features, x.gate_up_proj.out_features, x.num_heads,
                   x.num_kv_heads, x.head_dim) for x in layers}  # fmt: skip
        kernels = ops.kernels_or_none()
        if len(shapes) != 1 or kernels is None:
            return None
        return cls(layers, kernels)

    def serves(self, num_tokens: int) -> bool:
        """A decode-only step of `num_tokens` rows runs here."""
        return num_tokens <= self.max_rows

    def run_step(
        self,
        layers: Sequence[nn.Module],
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        plan: DecodeStepPlan,
    ) -> torch.Tensor:
        """Every layer of the step: `hidden` [m, H] (the embeddings, unpadded) is updated in
        place and returned, before the final norm."""
        if len(layers) != len(self._layers) or plan.prefix_blocks:
            raise ValueError("run_step takes every layer it was built for, without a prefix")
        with record_function(PROFILE_RANGE):
            done = self._kernels.decode_step_q8(
                self._layers, plan.kv_caches, hidden, cos, sin, plan.tables, plan.seq_lens,
                plan.slots, layers[0].scale,
            )  # fmt: skip
        if not done:
            raise RuntimeError(
                "the 8-bit decode step failed: a projection declined its shapes, or the "
                "attention had no memory for its buffers"
            )
        return hidden
