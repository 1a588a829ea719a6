"""8-bit block-quantized weights (models/quantized_linear.py, csrc/linear/linear_q8.c): the
kernel against the reference dequantize-then-matmul, and --weight-dtype's resolution."""

from __future__ import annotations

import pytest
import torch

from kvserve.config import LoadConfig
from kvserve.errors import ParameterError
from kvserve.models.quantized_linear import (
    ALL_ROWS,
    KERNEL_MAX_ROWS,
    Q8Linear,
    Q8Plan,
    dequantize_q8,
    q8_linear,
    q8_plan,
    quantize_q8,
)
from kvserve.native import ops

CPU = torch.device("cpu")
needs_kernel = pytest.mark.skipif(not ops.available(), reason="native library not built here")


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


def test_quantize_rounds_each_weight_to_its_block_scale():
    weight = _weight(7, 70)  # 70 = two blocks of 32 and a tail of 6
    weight[3, 32:64] = 0.0  # an all-zero block: scale 0, codes 0
    codes, scales = quantize_q8(weight)
    assert codes.shape == (7, 96) and codes.dtype == torch.int8 and scales.shape == (7, 3)
    assert scales[3, 1] == 0 and not codes[3, 32:64].any() and not codes[:, 70:].any()
    assert codes.abs().max() == 127  # each block's largest magnitude takes the top code
    error = (dequantize_q8(codes, scales, 70) - weight).abs()
    assert (error <= scales.repeat_interleave(32, dim=1)[:, :70] / 2 + 1e-9).all()


@needs_kernel
@pytest.mark.parametrize("n, k", [(96, 64), (960, 576), (40, 70), (33, 100), (576, 1536)])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 16])
def test_kernel_matches_dequantize_then_matmul(n, k, m):
    codes, scales = quantize_q8(_weight(n, k))
    bias = torch.randn(n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    want = x @ dequantize_q8(codes, scales, k).T + bias
    got = q8_linear(x, codes, scales, bias, None, k, ALL_ROWS)
    assert got.shape == (m, n)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_kernel_takes_strided_rows_and_leading_dims():
    codes, scales = quantize_q8(_weight(64, 96))
    wide = torch.randn(4, 128)
    rows = wide[:, :96]  # a row stride of 128
    want = rows @ dequantize_q8(codes, scales, 96).T
    assert torch.allclose(q8_linear(rows, codes, scales, None, None, 96, ALL_ROWS), want,
                          rtol=1e-5, atol=1e-5)  # fmt: skip
    batched = q8_linear(rows.reshape(2, 2, 96), codes, scales, None, None, 96, ALL_ROWS)
    assert torch.allclose(batched.reshape(4, 64), want, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_wrapper_refuses_other_dtypes():
    codes, scales = quantize_q8(_weight(64, 64))
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="linear_q8_f32"):
        ops.kernels().linear_q8(x.double(), codes, scales, None, torch.empty(2, 64))
    with pytest.raises(ValueError, match="linear_q8_f32"):
        ops.kernels().linear_q8(x, codes[:, :32].contiguous(), scales, None, torch.empty(2, 64))


def test_rows_above_the_kernel_take_the_float_or_dequantized_weight():
    weight = _weight(48, 64)
    x = torch.randn(20, 64)
    kept = Q8Linear(weight, None, kernel_rows=8, keep_float=True)
    assert torch.equal(kept(x), torch.nn.functional.linear(x, weight))
    dequantized = Q8Linear(weight, None, kernel_rows=8, keep_float=False)
    assert torch.equal(dequantized(x), x @ dequantized.dequantized().T)
    assert dequantized.weight is None


def test_weight_dtype_flag_is_validated():
    with pytest.raises(
        ParameterError, match="--weight-dtype must be one of auto, float, int8, int4"
    ):
        LoadConfig(weight_dtype="int2")
    with pytest.raises(ParameterError, match="--weight-dtype int8 weights are not sharded"):
        LoadConfig(weight_dtype="int8", tensor_parallel_size=2)
    assert LoadConfig(weight_dtype="auto", tensor_parallel_size=2).weight_dtype == "auto"
    with pytest.raises(ParameterError, match="--weight-dtype int8 weights run on a CPU only"):
        q8_plan("int8", torch.device("cuda"), torch.float32, "Q4_1")


@needs_kernel
def test_auto_quantizes_only_a_quantized_checkpoint_in_float32_on_a_cpu():
    assert q8_plan("auto", CPU, torch.float32, "Q4_1") == Q8Plan(KERNEL_MAX_ROWS, True, bits=4)
    assert q8_plan("auto", CPU, torch.float32, "Q8_0") == Q8Plan(KERNEL_MAX_ROWS, True)
    assert q8_plan("int4", CPU, torch.float32, "") == Q8Plan(KERNEL_MAX_ROWS, False, bits=4)
    assert q8_plan("auto", CPU, torch.float32, "") is None  # stored as floats
    assert q8_plan("auto", CPU, torch.bfloat16, "Q4_1") is None
    assert q8_plan("auto", torch.device("cuda"), torch.float32, "Q4_1") is None
    assert q8_plan("float", CPU, torch.float32, "Q4_1") is None
    assert q8_plan("int8", CPU, torch.bfloat16, "") == Q8Plan(KERNEL_MAX_ROWS, False)


@needs_kernel
@pytest.mark.parametrize("n, k", [(5, 64), (33, 70)])
def test_c_dequantize_equals_the_reference(n, k):
    codes, scales = quantize_q8(_weight(n, k))
    out = torch.empty(n, k)
    ops.kernels().dequantize_q8(codes, scales, out)
    assert torch.equal(out, dequantize_q8(codes, scales, k))
