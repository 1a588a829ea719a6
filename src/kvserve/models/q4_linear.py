"""Linear layers over 4-bit block-quantized weights (--weight-dtype int4), for a CPU's decode.

A weight is GGUF's Q4_1: per block of 32 consecutive inputs of an output row, a scale d and a
minimum m (float32 here), and 4-bit codes q in 0..15, W = d q + m: 0.625 bytes a weight,
against int8's 1.125 (quantized_linear.py).  `quantize_q4` is llama.cpp's reference Q4_1
quantizer (m the block's minimum, d its range / 15), so a GGUF whose projections are Q4_1
from that quantizer comes back with its own codes, and with its d and m up to float32
rounding (tests/unit/test_q4_linear.py checks the embedded model's file).

native/csrc/linear/linear_q4.c multiplies float32 rows with it for steps of up to
`kernel_rows` rows, rounding each row's block of 32 activations to 8 bits (llama.cpp's Q8_1)
so that each block's dot product is an integer one; `q4_reference` is that arithmetic in
torch.  Above `kernel_rows` rows the product is torch's, over the float weight where it is
kept (--weight-dtype auto) or over the weight dequantized for the call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.native import ops

QBLOCK = 32  # inputs per scale and minimum
LEVELS = 15  # codes 0..15


def quantize_q4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] (K a multiple of 32) -> codes [N, K / 2] uint8 (per block of 32, input j
    in byte j's low nibble and input j + 16 in its high nibble), scales and mins [N, K / 32]
    float32: llama.cpp's quantize_row_q4_1_ref (m = min, d = (max - m) / 15, q = (w - m) / d
    rounded half up, at most 15)."""
    rows, k = weight.shape
    if k % QBLOCK:
        raise ValueError(f"int4 weights need inputs in whole blocks of {QBLOCK}, not {k}")
    blocks = weight.detach().float().reshape(rows, k // QBLOCK, QBLOCK)
    mins, maxs = blocks.amin(dim=-1), blocks.amax(dim=-1)
    scales = (maxs - mins) / LEVELS
    inverse = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
    codes = ((blocks - mins[..., None]) * inverse[..., None] + 0.5).to(torch.int32)
    codes = codes.clamp_(0, LEVELS).to(torch.uint8)
    packed = codes[..., : QBLOCK // 2] | (codes[..., QBLOCK // 2 :] << 4)
    return packed.reshape(rows, k // 2).contiguous(), scales.contiguous(), mins.contiguous()


def unpack_q4(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K / 2] uint8 -> the 4-bit values [N, K] in input order (uint8)."""
    rows, half = codes.shape
    blocks = codes.view(rows, half // (QBLOCK // 2), QBLOCK // 2)
    return torch.cat((blocks & 0x0F, blocks >> 4), dim=-1).reshape(rows, 2 * half)


def dequantize_q4(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """The float32 weight [N, K] that the blocks stand for: d q + m."""
    values = unpack_q4(codes).float().view(codes.shape[0], -1, QBLOCK)
    return (values * scales[..., None] + mins[..., None]).view(codes.shape[0], -1)


def quantize_rows_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations x [M, K] float32 -> codes [M, K / 32, 32] (int32 values in -127..127) and
    scales e [M, K / 32]: e = max|x| / 127 per block (0 where the block is all zero), codes
    round(x / e) to nearest even (linear_q4.c's quantize_row)."""
    blocks = x.float().reshape(x.shape[0], -1, QBLOCK)
    amax = blocks.abs().amax(dim=-1)
    safe = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    codes = torch.round(blocks / safe[..., None]).to(torch.int32)
    return codes, torch.where(amax > 0, safe, torch.zeros_like(amax))


def q4_reference(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """linear_q4.c's product in torch: x [M, K] float32 rounded to 8-bit blocks, each block's
    integer dot product with the codes exact (in float64, below 2^53), then d e sum(q a) +
    m e sum(a) summed over blocks in float32."""
    a, e = quantize_rows_q8(x)
    q = unpack_q4(codes).view(codes.shape[0], -1, QBLOCK).to(torch.float64)
    dots = torch.einsum("mbk,nbk->mnb", a.to(torch.float64), q).float()  # exact integers
    terms = dots * (scales[None] * e[:, None]) + mins[None] * (e * a.sum(-1).float())[:, None]
    out = terms.sum(-1)
    return out if bias is None else out + bias


_LIBRARY = torch.library.Library("kvserve", "FRAGMENT")
_LIBRARY.define(
    "q4_linear(Tensor x, Tensor codes, Tensor scales, Tensor mins, Tensor? bias, "
    "Tensor? weight, int kernel_rows) -> Tensor"
)


def _q4_linear(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    bias: torch.Tensor | None,
    weight: torch.Tensor | None,
    kernel_rows: int,
) -> torch.Tensor:
    """x [..., K] -> [..., N]: the kernel up to `kernel_rows` rows; above (or without the
    library), torch's product over `weight` (the float one, where kept) or the blocks
    dequantized for this call."""
    rows = x.reshape(-1, 2 * codes.shape[1])
    out = None
    kernels = ops.kernels_or_none()
    if rows.shape[0] <= kernel_rows and kernels is not None:
        flat = rows.float().contiguous()
        out = flat.new_empty((flat.shape[0], codes.shape[0]))
        out = out if kernels.linear_q4(flat, codes, scales, mins, bias, out) else None
        out = None if out is None else out.to(x.dtype)
    if out is None:
        if weight is None:
            weight = dequantize_q4(codes, scales, mins).to(x.dtype)
        out = F.linear(rows, weight, None if bias is None else bias.to(x.dtype))
    return out.view(*x.shape[:-1], codes.shape[0])


_LIBRARY.impl("q4_linear", _q4_linear, "CPU")


@torch.library.register_fake("kvserve::q4_linear")
def _(x, codes, scales, mins, bias, weight, kernel_rows):  # noqa: ANN001, ANN202 - fake op
    return x.new_empty((*x.shape[:-1], codes.shape[0]))


q4_linear = torch.ops.kvserve.q4_linear.default


class Q4Linear(nn.Module):
    """y = x @ W^T + b with W kept as 4-bit blocks (inference only); `keep_float` also keeps
    the float weight for the steps above `kernel_rows` rows."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, kernel_rows: int, keep_float: bool
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        codes, scales, mins = quantize_q4(weight)
        self.register_buffer("codes", codes, persistent=False)
        self.register_buffer("scales", scales, persistent=False)
        self.register_buffer("mins", mins, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().float(),
                             persistent=False)  # fmt: skip
        self.register_buffer("weight", weight.detach() if keep_float else None, persistent=False)
        self.kernel_rows = kernel_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return q4_linear(x, self.codes, self.scales, self.mins, self.bias, self.weight,
                         self.kernel_rows)  # fmt: skip

    def dequantized(self) -> torch.Tensor:
        """The float32 weight this layer's blocks stand for."""
        return dequantize_q4(self.codes, self.scales, self.mins)
