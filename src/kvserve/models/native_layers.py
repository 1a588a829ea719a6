"""The layers' work between attentions through native/csrc/layer/decode_layer.c: one C call
per layer.

Through torch.compile the same work costs ~0.35 ms a layer more than its projections alone
(Dynamo's guards, the compiled region's wrappers, the custom ops' dispatch and Python,
inductor's element-wise kernels), at any row count: ~10 ms of a 128-row decode step of the
embedded model.  At a prefill step's rows, inductor's element-wise kernels and the separate
SiLU pass cost more than the projections' kernel change does: a 2,048-token step of the
embedded model took 973 against 1,016 ms (docs/decisions/native-layers.md).  This path
serves every step where each projection takes the library's projection kernel (AMX tiles,
or vdpbf16ps on a CPU without AMX) at every row count (packed_linear.KERNEL_ALL_ROWS), with
the compiled layers' values bit for bit: the same projection kernels, and inductor's
element-wise arithmetic written out in C.  The object has LayerKernels' three functions, so
LlamaForCausalLM.forward calls it in their place.  On the AMD EPYC without AMX it took W1's
128-row decode step from 174 to 129 ms (docs/decisions/native-layers.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.profiler import record_function

from kvserve.attention.base import DecodeStepPlan
from kvserve.models.packed_linear import KERNEL_ALL_ROWS, PackedLinear, packed_block_cols
from kvserve.native import ops
from kvserve.native.structs import DecodeLayer

# The profiler range of each call (benchmarks/profile_offline.py reports it on its own).
PROFILE_RANGE = "kvserve::native_layers"


def native_kernels() -> ops.Kernels | None:
    """The native library where it has the decode layer kernels (a build with a projection
    kernel: AVX512-BF16 or AMX), else None."""
    kernels = ops.kernels_or_none()
    return kernels if kernels is not None and kernels.has_decode_layers() else None


def _packed_pointer(linear: nn.Module) -> int:
    return torch.ops.mkldnn.data_ptr(linear.packed_weight)


def _describe(layer: nn.Module) -> DecodeLayer:
    """The C description of one DecoderLayer (its tensors must outlive it: the layer's own)."""
    qkv_bias = layer.qkv_proj.bias
    return DecodeLayer(
        input_norm=layer.input_layernorm.weight.data_ptr(),
        qkv=_packed_pointer(layer.qkv_proj),
        qkv_bias=None if qkv_bias is None else qkv_bias.data_ptr(),
        o=_packed_pointer(layer.o_proj),
        post_norm=layer.post_attention_layernorm.weight.data_ptr(),
        gate_up=_packed_pointer(layer.gate_up_proj),
        down=_packed_pointer(layer.down_proj),
        hidden=layer.o_proj.out_features,
        intermediate=layer.gate_up_proj.out_features // 2,
        num_heads=layer.num_heads,
        num_kv_heads=layer.num_kv_heads,
        head_dim=layer.head_dim,
        eps=layer.input_layernorm.eps,
    )


def _runs_natively(layer: nn.Module) -> bool:
    """This layer's work runs here: every projection packed, in bfloat16, on the library's
    projection kernel (AMX, or vdpbf16ps without it) at every row count, with the shapes the C
    code takes (a plain Llama layer: no q/k norms, no Gemma norms or GELU)."""
    if not getattr(layer, "is_plain", True):
        return False
    projections = (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
    if not all(isinstance(p, PackedLinear) for p in projections) or not layer.fused_silu:
        return False
    if any(p.kernel_rows != KERNEL_ALL_ROWS for p in projections):
        return False
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if any(n.weight.dtype != torch.bfloat16 or not n.weight.is_contiguous() for n in norms):
        return False
    if layer.input_layernorm.eps != layer.post_attention_layernorm.eps:
        return False
    hidden, intermediate = layer.o_proj.out_features, layer.gate_up_proj.out_features // 2
    biased = any(p.bias is not None for p in projections[1:])
    block_cols = packed_block_cols()
    if biased or not block_cols or intermediate % block_cols:
        return False
    return not (hidden % 32 or layer.head_dim % 32)


class NativeLayers:
    """LayerKernels' pre_attention / between_attentions / post_attention in C, for every step
    (the padded row counts that `serves` accepts)."""

    def __init__(self, layers: Sequence[nn.Module], kernels: ops.Kernels) -> None:
        self._kernels = kernels
        self._layers = {id(layer): _describe(layer) for layer in layers}
        # The same descriptions in the layers' order, contiguous, for decode_step.
        self._all_layers = kernels.decode_layers([self._layers[id(x)] for x in layers])
        # decode_step_layers sizes its buffers and reads V by the first layer's shape.
        shapes = {(d.hidden, d.intermediate, d.num_heads, d.num_kv_heads, d.head_dim)
                  for d in self._all_layers}  # fmt: skip
        self.runs_whole_steps = len(shapes) == 1

    @classmethod
    def build(cls, layers: Sequence[nn.Module]) -> NativeLayers | None:
        """For these layers, or None where the C path cannot serve them (no such build, layers
        not packed in bfloat16, shapes the C code does not take)."""
        if not layers or not all(_runs_natively(layer) for layer in layers):
            return None
        kernels = native_kernels()  # the layers first: no library on a GPU
        return None if kernels is None else cls(layers, kernels)

    @staticmethod
    def serves(num_rows: int) -> bool:
        """A step of `num_rows` rows (padded: packed_linear.padded_rows) runs here."""
        return num_rows % 16 == 0

    @staticmethod
    def _outputs(
        layer: nn.Module, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Fresh q, k and qkv tensors for `layer` at hidden's row count."""
        rows, dim = hidden.shape[0], layer.head_dim
        q = hidden.new_empty((rows, layer.num_heads, dim))
        k = hidden.new_empty((rows, layer.num_kv_heads, dim))
        qkv = hidden.new_empty((rows, (layer.num_heads + 2 * layer.num_kv_heads) * dim))
        return q, k, qkv

    @staticmethod
    def _value(layer: nn.Module, qkv: torch.Tensor) -> torch.Tensor:
        start = (layer.num_heads + layer.num_kv_heads) * layer.head_dim
        return qkv[:, start:].view(qkv.shape[0], layer.num_kv_heads, layer.head_dim)

    @staticmethod
    def _run(call: Callable[..., bool], *args: object) -> None:
        """One C call, as a profiler range of its own."""
        with record_function(PROFILE_RANGE):
            done = call(*args)
        if not done:
            raise RuntimeError(
                "the native decode kernels failed: a projection declined its shapes, or the "
                "attention had no memory for its buffers"
            )

    def _layer(self, layer: nn.Module) -> DecodeLayer:
        return self._layers[id(layer)]

    def pre_attention(
        self, layer: nn.Module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, qkv = self._outputs(layer, hidden)
        self._run(self._kernels.decode_pre_attention, self._layer(layer), hidden, cos, sin, q, k,
                  qkv)  # fmt: skip
        return q, k, self._value(layer, qkv)

    def between_attentions(
        self,
        layer: nn.Module,
        next_layer: nn.Module,
        hidden: torch.Tensor,
        attn: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """As llama.between_attentions; `hidden` is updated in place and returned."""
        attn = attn.to(hidden.dtype).contiguous()
        q, k, qkv = self._outputs(next_layer, hidden)
        self._run(self._kernels.decode_between_attentions, self._layer(layer),
                  self._layer(next_layer), hidden, attn, cos, sin, q, k, qkv)  # fmt: skip
        return hidden, q, k, self._value(next_layer, qkv)

    def post_attention(
        self, layer: nn.Module, hidden: torch.Tensor, attn: torch.Tensor
    ) -> torch.Tensor:
        """As llama.post_attention; `hidden` is updated in place and returned."""
        attn = attn.to(hidden.dtype).contiguous()
        self._run(self._kernels.decode_post_attention, self._layer(layer), hidden, attn)
        return hidden

    def run_step(
        self,
        layers: Sequence[nn.Module],
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        num_tokens: int,
        plan: DecodeStepPlan,
    ) -> torch.Tensor:
        """Every layer of a decode step, attention included, in one C call (decode_step_layers
        in native/csrc/layer/decode_layer.c): the per-layer calls' values bit for bit, without
        the Python between them.  `layers` must be the ones this object was built for, in
        order; `hidden` is updated in place and returned (before the final norm)."""
        if len(layers) != len(self._all_layers) or not self.runs_whole_steps:
            raise ValueError("run_step takes all the layers it was built for, of one shape")
        first = layers[0]
        q, k, qkv = self._outputs(first, hidden)
        attn = hidden.new_empty((num_tokens, first.num_heads * first.head_dim))
        self._run(
            self._kernels.decode_step, self._all_layers, plan.kv_caches, hidden, cos, sin, q, k,
            qkv, attn, plan.tables, plan.seq_lens, plan.slots, first.scale,
            plan.prefix_table if plan.prefix_blocks else None, plan.prior_out, plan.prior_lse,
        )  # fmt: skip
        return hidden
