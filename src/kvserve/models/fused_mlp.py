"""SiLU(gate) x up of a bfloat16 model's MLP on a CPU, through native/csrc/layer/silu_mul.c.

Inductor compiles `F.silu(gate) * up` into one vectorized loop, but with a 1-ulp exp and a
true division per value: 1.23 ms a layer for a 2,048-token prefill step of the embedded
model, compute-bound (copying the same 12 MB takes 0.5 ms).  The C kernel uses a polynomial
exp and a refined reciprocal, within ~2 float32 ulp of torch's, which rounding the product to
bfloat16 hides except on rare ties (tests/unit/test_fused_mlp.py bounds the difference).
Float32 models keep torch's expression, and with it their exact parity with transformers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.models.packed_linear import on_bucketed_rows
from kvserve.native import ops


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2n] (gate, then up) -> [..., n]: the reference expression."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def fused_silu_available(device: torch.device, dtype: torch.dtype) -> bool:
    """The C kernel serves this model: bfloat16 on a CPU, built with AVX512-BF16."""
    if device.type != "cpu" or dtype != torch.bfloat16 or not ops.available():
        return False
    probe = torch.zeros(1, 32, dtype=torch.bfloat16)
    return _silu_mul_in_c(probe) is not None


def _silu_mul_in_c(gate_up: torch.Tensor) -> torch.Tensor | None:
    """The C kernel's result, or None where it does not apply (layout, or a build without
    AVX512-BF16, which declines)."""
    rows = gate_up.reshape(-1, gate_up.shape[-1])
    kernels = ops.kernels_or_none()
    if kernels is None or rows.stride(-1) != 1 or gate_up.shape[-1] % 2:
        return None
    n = rows.shape[1] // 2
    out = rows.new_empty((rows.shape[0], n))
    return out.view(*gate_up.shape[:-1], n) if kernels.silu_mul(rows, out) else None


# An operator of our own (as packed_linear.py's), so that the compiled layers call the C
# kernel as one opaque step instead of tracing into ctypes.
_LIBRARY = torch.library.Library("kvserve", "FRAGMENT")
_LIBRARY.define("silu_mul(Tensor gate_up) -> Tensor")


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    out = _silu_mul_in_c(gate_up) if gate_up.dtype == torch.bfloat16 else None
    return silu_and_mul(gate_up) if out is None else out


_LIBRARY.impl("silu_mul", _silu_mul, "CPU")


@torch.library.register_fake("kvserve::silu_mul")
def _(gate_up: torch.Tensor) -> torch.Tensor:
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


fused_silu_mul = torch.ops.kvserve.silu_mul.default


# SiLU x up fused into the gate_up projection itself (csrc/linear/linear_amx.c or linear_dot.c,
# silu_gate_up_bf16_packed): each thread multiplies the gate and up blocks it computed, so
# no [rows, 2 x features] tensor is written and read back across the cores.
_LIBRARY.define(
    "packed_silu_gate_up(Tensor x, Tensor packed_weight, int features, int kernel_rows) -> Tensor"
)


def _packed_silu_gate_up(
    x: torch.Tensor, packed_weight: torch.Tensor, features: int, kernel_rows: int
) -> torch.Tensor:
    """SiLU(x Wg^T) x (x Wu^T) for a packed gate_up weight [Wg; Wu]: up to `kernel_rows` rows in
    one call of the projection kernel, else oneDNN's projection and the SiLU kernel."""

    def compute(rows: torch.Tensor) -> torch.Tensor:  # [M, in], M bucketed
        fits = rows.shape[0] <= kernel_rows and rows.stride(1) == 1
        kernels = ops.kernels_or_none() if fits else None
        if kernels is not None:
            out = rows.new_empty((rows.shape[0], features))
            if kernels.silu_gate_up_packed(rows, packed_weight, out):
                return out
        gate_up = torch.ops.mkldnn._linear_pointwise(rows, packed_weight, None, "none", [], "")
        # Through the operator (not _silu_mul): the profiler then tells this step's SiLU from
        # the projection around it (benchmarks/profile_offline.py counts the rest as linear).
        return fused_silu_mul(gate_up)

    return on_bucketed_rows(x, compute, features)


for _key in ("CPU", "MkldnnCPU"):  # x is a CPU tensor; the packed weight is a oneDNN one
    _LIBRARY.impl("packed_silu_gate_up", _packed_silu_gate_up, _key)


@torch.library.register_fake("kvserve::packed_silu_gate_up")
def _(
    x: torch.Tensor, packed_weight: torch.Tensor, features: int, kernel_rows: int
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], features))


packed_silu_gate_up = torch.ops.kvserve.packed_silu_gate_up.default
