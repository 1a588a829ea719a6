"""Linear layers with their weights prepacked for oneDNN (bfloat16/float16 on a CPU).

`F.linear` on a CPU hands a plain row-major weight to oneDNN, which reorders it into its
blocked layout (AMX/AVX-512 tiles) on every call.  Reordering once at load time measured
1.5-1.6x faster for the decode shapes of the embedded model (128 rows x 576-3,072 columns,
one thread) and 2.2x for its 49,152-row LM head; prefill shapes gain ~1.1x; float32 gains
nothing, so float32 keeps `nn.Linear` (and its bit-exact parity with transformers).  The
packed op returns the same values as `F.linear` (checked in tests/model/test_fast_paths.py).
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable

import torch
from torch import nn

from kvserve.native import ops

logger = logging.getLogger("kvserve")

PACKED_DTYPES = (torch.bfloat16, torch.float16)
# Every row count of a bfloat16 projection goes through native/csrc/linear/linear_amx.c over
# oneDNN's packed weight.  At a decode step's rows it streams the weight faster than oneDNN does
# (W1's 128-row decode step 105 -> 101 ms); at a prefill step's it runs in chunks of 256 rows
# (linear_amx.c) and fuses SiLU x up into the gate_up projection: a layer's
# qkv, o and down projections at 256 / 512 / 1,024 / 2,048 rows took 1.62 / 3.78 / 8.02 / 14.3
# ms against oneDNN's 1.88 / 5.73 / 11.5 / 14.4, and gate_up with its SiLU 1.52 / 3.47 / 6.95 /
# 12.9 against 1.88 / 4.66 / 7.35 / 14.5 (docs/decisions/projection-kernels.md).
KERNEL_ALL_ROWS = sys.maxsize
# The LM head (49,152 x 576 for the embedded model) is the exception on AMX: oneDNN streams it
# faster past 32 rows (one process, alternating: 64 rows 2.56 against 2.14 ms, 128 rows 5.57
# against 3.82 ms; 16 rows 1.34 against 1.44 ms, 32 rows 1.55 against 1.77 ms).
LOGITS_KERNEL_MAX_ROWS = 32


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN prepacking is worth it (and available) here."""
    return device.type == "cpu" and dtype in PACKED_DTYPES and _onednn_packs(dtype)


@functools.cache
def _onednn_packs(dtype: torch.dtype) -> bool:
    """oneDNN reorders a `dtype` weight on this CPU.  Its bf16 and fp16 paths need AVX512
    (BW/VL/DQ, or FP16) or AVX-NE-CONVERT: on an AVX2-only CPU (AMD Zen 3, for one) the
    reorder raises, and the plain `nn.Linear` (which converts on the fly) is the way.
    Asked of oneDNN itself with a tiny weight, so that no CPU-flag list can drift from it."""
    if not (
        torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    ):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), None)
    except RuntimeError as error:
        logger.info("linear layers stay unpacked in %s: %s", dtype, error)
        return False
    return True


def padded_rows(num_rows: int) -> int:
    """The row count oneDNN is asked for: rounded up to a multiple of 16 (to 256 rows), of 64
    (to 2,048) or of 256.  oneDNN compiles and caches one primitive per shape; a step's token
    count takes any value, so without buckets the cache fills to its 1,024 primitives and the
    process's memory grows for hours (docs/decisions/packed-linear.md).  With them the model's
    five weight shapes need ~300 primitives; the padding costs at most 1/16 more rows."""
    step = 16 if num_rows <= 256 else 64 if num_rows <= 2048 else 256
    return -(-num_rows // step) * step


# An operator of our own, so that torch.compile calls it as one opaque kernel (inductor cannot
# lower the raw oneDNN op).  Defined through torch.library.Library with plain kernels for the
# CPU and oneDNN dispatch keys, not `torch.library.custom_op`: that wrapper's autograd and
# view handling cost ~35-50 us a call (measured 147 -> 113 us for 32 rows x 576 -> 3,072, one
# call of the 121 per decode step), more than a third of the matrix product at decode shapes.
_LIBRARY = torch.library.Library("kvserve", "FRAGMENT")
_LIBRARY.define(
    "packed_linear(Tensor x, Tensor packed_weight, Tensor? bias, int out_features, "
    "int kernel_rows) -> Tensor"
)


def _packed_linear(
    x: torch.Tensor,
    packed_weight: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    kernel_rows: int,
) -> torch.Tensor:
    """x [..., in] -> [..., out] with a prepacked weight, on a bucketed row count: through
    the library's projection kernel up to `kernel_rows` rows (0: never), oneDNN otherwise."""
    return on_bucketed_rows(
        x, lambda rows: _linear_rows(rows, packed_weight, bias, out_features, kernel_rows),
        out_features,
    )  # fmt: skip


def on_bucketed_rows(
    x: torch.Tensor, compute: Callable[[torch.Tensor], torch.Tensor], out_features: int
) -> torch.Tensor:
    """compute(rows) for x [..., in] -> [..., out_features], where rows [M, in] has a bucketed
    row count (padded_rows): x itself when it already is such rows, as the model's layers
    pass them (LlamaForCausalLM._padded; no reshapes or slice around the call, ~4 us of 27),
    else x flattened, padded with zero rows, and the padding's outputs dropped."""
    if x.dim() == 2 and padded_rows(x.shape[0]) == x.shape[0]:
        return compute(x)
    rows = x.reshape(-1, x.shape[-1])
    num_rows = rows.shape[0]
    padded = padded_rows(num_rows)
    if padded != num_rows:
        rows = _pad_rows(rows, padded)
    return compute(rows)[:num_rows].reshape(*x.shape[:-1], out_features)


def _linear_rows(
    rows: torch.Tensor,  # [M, in], M bucketed (padded_rows)
    packed_weight: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    kernel_rows: int,
) -> torch.Tensor:
    if rows.shape[0] <= kernel_rows and rows.stride(1) == 1:
        out = _kernel_linear(rows, packed_weight, bias, out_features)
        if out is not None:
            return out
    return torch.ops.mkldnn._linear_pointwise(rows, packed_weight, bias, "none", [], "")


def _kernel_linear(
    rows: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor | None:
    """The native projection kernel (native/csrc/linear/linear_amx.c, or linear_dot.c) over
    oneDNN's packed weight, or None where it declines."""
    kernels = ops.kernels_or_none()
    if kernels is None:
        return None
    out = rows.new_empty((rows.shape[0], out_features))
    return out if kernels.linear_packed(rows, packed_weight, bias, out) else None


def _pad_rows(rows: torch.Tensor, padded: int) -> torch.Tensor:
    """rows [n, k] followed by zero rows, [padded, k].  Only the added rows are zeroed:
    F.pad zeroes the whole new tensor before copying the rows over it, which cost as much as
    the copy (~0.25 ms a call at 2,048 x 1,536, four calls a layer in a prefill step)."""
    out = rows.new_empty((padded, rows.shape[1]))
    out[: rows.shape[0]].copy_(rows)
    out[rows.shape[0] :].zero_()
    return out


@functools.cache
def packed_block_cols() -> int:
    """The column block of the layout the projection kernels read (oneDNN packs a bf16 weight
    in blocks of 32 columns for AMX, 64 for AVX512-BF16 without it), 0 where there are none.
    silu_gate_up splits its weight [Wg; Wu] at a block: features must be a multiple."""
    kernels = ops.kernels_or_none()
    return 0 if kernels is None else kernels.packed_block_cols()


def logits_kernel_max_rows() -> int:
    """Up to how many rows the LM head goes through the projection kernel: 32 for the AMX one
    (above), every row count for linear_dot.c's vdpbf16ps one, at par with oneDNN or faster
    at 16-128 rows (AMD EPYC, alternating: 16 rows 2.85-3.16 against 3.74-3.93 ms, 64 rows
    9.52-10.46 against 10.31-10.61, 128 rows 18.69-19.00 against 18.74-19.17)."""
    return LOGITS_KERNEL_MAX_ROWS if packed_block_cols() == 32 else KERNEL_ALL_ROWS


def kernel_rows_for(weight: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> int:
    """Up to how many rows this packed weight goes through the library's projection kernel
    (csrc/linear/linear_amx.c on AMX, linear_dot.c on AVX512-BF16 without it): KERNEL_ALL_ROWS where
    the kernel runs and reads oneDNN's layout of this weight correctly (checked on 16 random
    rows against oneDNN itself: another oneDNN version or CPU may pack differently), else 0."""
    if weight.dtype != torch.bfloat16 or weight.shape[1] % 32 or not ops.available():
        return 0
    rows = torch.randn(16, weight.shape[1], generator=torch.Generator().manual_seed(0))
    rows = rows.to(torch.bfloat16)
    try:
        got = _kernel_linear(rows, packed, bias, weight.shape[0])
    except RuntimeError:  # no oneDNN data pointer for this tensor
        return 0
    want = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    if got is None or not torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2):
        return 0
    return KERNEL_ALL_ROWS


for _key in ("CPU", "MkldnnCPU"):  # x is a CPU tensor; the packed weight is a oneDNN one
    _LIBRARY.impl("packed_linear", _packed_linear, _key)


@torch.library.register_fake("kvserve::packed_linear")
def _(
    x: torch.Tensor,
    packed_weight: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    kernel_rows: int,
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


packed_linear = torch.ops.kvserve.packed_linear.default


class PackedLinear(nn.Module):
    """y = x @ W^T + b with W kept in oneDNN's blocked layout (inference only)."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        kernel_max_rows: int = KERNEL_ALL_ROWS,
    ) -> None:
        super().__init__()
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach(), persistent=False)
        self.kernel_rows = min(kernel_rows_for(weight, packed, self.bias), kernel_max_rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed_weight, self.bias, self.out_features, self.kernel_rows)


def pack_linear_layers(model: nn.Module) -> int:
    """Replace every nn.Linear inside `model` by a PackedLinear; the number replaced."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear(child.weight, child.bias))
                replaced += 1
    return replaced
