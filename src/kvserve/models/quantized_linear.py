"""Linear layers over 8-bit block-quantized weights (--weight-dtype int8), for a CPU's decode.

A decode step on a CPU is bound by reading the weights: the embedded model's float32
projections and LM head are ~540 MB a step.  Here a weight is int8 codes with one float32
scale per block of 32 consecutive input features of an output row (as GGUF's Q8_0): 1.125
bytes a weight instead of 4.  native/csrc/linear/linear_q8.c multiplies float32 rows with it,
dequantizing in registers; above `kernel_rows` rows (prefill, large batches) the product is
torch's, over the float weight where it is kept (--weight-dtype auto) or over the weight
dequantized for the call (int8).  `dequantize_q8` is the reference: the kernel's result
equals x @ dequantize_q8(...).T up to the order of the float32 sums
(tests/unit/test_quantized_linear.py).
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.errors import ParameterError
from kvserve.models.q4_linear import QBLOCK as Q4_BLOCK
from kvserve.models.q4_linear import Q4Linear
from kvserve.native import ops

logger = logging.getLogger("kvserve")

QBLOCK = 32  # input features per scale
QMAX = 127  # codes in [-127, 127]: symmetric, so zero is exact
# The most rows the kernel takes: above, torch's product (MKL) over the float weight is
# faster, and over the weight dequantized for the call about as fast (a 256-token prefill
# step of the embedded model took 2.1 s through the kernel against 0.86 s in float32, one
# thread; docs/decisions/int8-weights.md).
KERNEL_MAX_ROWS = 8
ALL_ROWS = sys.maxsize


def quantize_q8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] (any float dtype) -> (codes [N, Kp] int8, scales [N, Kp / 32] float32),
    Kp = K rounded up to 32 (zeros past K): each block's scale is its largest magnitude / 127,
    each code the weight / scale rounded to nearest (ties to even)."""
    rows, k = weight.shape
    padded = -(-k // QBLOCK) * QBLOCK
    blocks = F.pad(weight.detach().float(), (0, padded - k)).view(rows, padded // QBLOCK, QBLOCK)
    scales = blocks.abs().amax(dim=-1) / QMAX
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(blocks / safe[..., None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return codes.view(rows, padded).contiguous(), scales.contiguous()


def dequantize_q8(codes: torch.Tensor, scales: torch.Tensor, in_features: int) -> torch.Tensor:
    """The float32 weight [N, in_features] that codes and scales stand for (the reference)."""
    rows, padded = codes.shape
    blocks = codes.view(rows, padded // QBLOCK, QBLOCK).float() * scales[..., None]
    return blocks.view(rows, padded)[:, :in_features]


# An operator of our own (as packed_linear.py's), so that the compiled layers call the C
# kernel as one opaque step instead of tracing into ctypes.
_LIBRARY = torch.library.Library("kvserve", "FRAGMENT")
_LIBRARY.define(
    "q8_linear(Tensor x, Tensor codes, Tensor scales, Tensor? bias, Tensor? weight, "
    "int in_features, int kernel_rows) -> Tensor"
)


def _q8_linear(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    weight: torch.Tensor | None,
    in_features: int,
    kernel_rows: int,
) -> torch.Tensor:
    """x [..., in] -> [..., out]: the kernel up to `kernel_rows` rows; above, torch's product
    over `weight` (the float one, where kept) or the codes dequantized for this call."""
    rows = x.reshape(-1, in_features)
    out = None
    if rows.shape[0] <= kernel_rows:
        out = _kernel_rows(rows, codes, scales, bias)
    if out is None:
        if weight is None:
            weight = _dequantized(codes, scales, in_features).to(x.dtype)
        out = F.linear(rows, weight, bias if bias is None else bias.to(x.dtype))
    return out.view(*x.shape[:-1], codes.shape[0])


def _kernel_rows(
    rows: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """The C kernel's product (in the rows' dtype: a bfloat16 model's rows are widened), or
    None where the library is not built here."""
    kernels = ops.kernels_or_none()
    if kernels is None:
        return None
    x = rows if rows.dtype is torch.float32 and rows.stride(1) == 1 else rows.float().contiguous()
    out = x.new_empty((x.shape[0], codes.shape[0]))
    if not kernels.linear_q8(x, codes, scales, bias, out):
        return None
    return out if rows.dtype is torch.float32 else out.to(rows.dtype)


def _dequantized(codes: torch.Tensor, scales: torch.Tensor, in_features: int) -> torch.Tensor:
    """dequantize_q8 through the C kernel where built (torch's took ~1 s of a 256-token
    prefill step of the embedded model, one thread; the C loop a fraction of it)."""
    kernels = ops.kernels_or_none()
    if kernels is None:
        return dequantize_q8(codes, scales, in_features)
    out = scales.new_empty((codes.shape[0], in_features))
    kernels.dequantize_q8(codes, scales, out)
    return out


_LIBRARY.impl("q8_linear", _q8_linear, "CPU")


@torch.library.register_fake("kvserve::q8_linear")
def _(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    weight: torch.Tensor | None,
    in_features: int,
    kernel_rows: int,
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], codes.shape[0]))


q8_linear = torch.ops.kvserve.q8_linear.default


class Q8Linear(nn.Module):
    """y = x @ W^T + b with W kept as 8-bit blocks (inference only); `keep_float` also keeps
    the float weight for the steps above `kernel_rows` rows."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        kernel_rows: int = ALL_ROWS,
        keep_float: bool = False,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        codes, scales = quantize_q8(weight)
        self.register_buffer("codes", codes, persistent=False)
        self.register_buffer("scales", scales, persistent=False)
        # The kernel takes float32 bias values; a bfloat16 model's are widened once here.
        self.register_buffer("bias", None if bias is None else bias.detach().float(),
                             persistent=False)  # fmt: skip
        self.register_buffer("weight", weight.detach() if keep_float else None, persistent=False)
        self.kernel_rows = kernel_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return q8_linear(x, self.codes, self.scales, self.bias, self.weight, self.in_features,
                         self.kernel_rows)  # fmt: skip

    def dequantized(self) -> torch.Tensor:
        """The float32 weight this layer multiplies by (the reference's)."""
        return dequantize_q8(self.codes, self.scales, self.in_features)


def quantize_linear_layers(
    model: nn.Module, kernel_rows: int, keep_float: bool, bits: int = 8
) -> int:
    """Replace every nn.Linear inside `model` by a Q8Linear, or with bits=4 by a Q4Linear
    (a Q8Linear where its inputs are not whole blocks of 32); the number replaced."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                four = bits == 4 and child.in_features % Q4_BLOCK == 0
                kind = Q4Linear if four else Q8Linear
                setattr(parent, name, kind(child.weight, child.bias, kernel_rows, keep_float))
                replaced += 1
    return replaced


@dataclass(frozen=True)
class Q8Plan:
    """Which steps a model's projections and LM head take the int8 kernel for: up to
    `kernel_rows` rows; above, the float weight where `keep_float`, else the codes
    dequantized for the call."""

    kernel_rows: int
    keep_float: bool
    # The layers' projections as 8-bit blocks (Q8Linear) or 4-bit ones (Q4Linear); the LM
    # head is 8-bit either way.
    bits: int = 8


def q8_plan(
    weight_dtype: str, device: torch.device, dtype: torch.dtype, stored_weight_type: str
) -> Q8Plan | None:
    """--weight-dtype as this model and machine resolve it; None: float weights.  auto takes
    quantized copies only where the checkpoint's own weights are quantized, on a CPU computing
    in float32, with the kernel built: a Q4_1 GGUF's own 4-bit blocks, else int8 copies (an
    8-bit rounding of a Q8_0 or 4-bit file's values moves the model far less than the file's
    own quantization did)."""
    if weight_dtype == "float":
        return None
    if weight_dtype in ("int8", "int4"):
        if device.type != "cpu":
            raise ParameterError(
                "--weight-dtype", f"{weight_dtype} weights run on a CPU only, not {device}; "
                "use --weight-dtype float (or auto)",
            )  # fmt: skip
        if not ops.available():
            logger.warning("--weight-dtype %s without the native library: every step "
                           "dequantizes its weights, slowly", weight_dtype)  # fmt: skip
        return Q8Plan(KERNEL_MAX_ROWS, keep_float=False, bits=4 if weight_dtype == "int4" else 8)
    if device.type == "cpu" and dtype == torch.float32 and stored_weight_type and ops.available():
        # A Q4_1 file's projections come back as their own 4-bit blocks (q4_linear.py), read
        # in 0.625 bytes a weight instead of 1.125 (docs/decisions/int4-weights.md)
        return Q8Plan(
            KERNEL_MAX_ROWS, keep_float=True, bits=4 if stored_weight_type == "Q4_1" else 8
        )
    return None
