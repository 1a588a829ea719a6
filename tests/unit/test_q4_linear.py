"""4-bit block-quantized weights (models/q4_linear.py, native/csrc/linear/linear_q4.c): the
quantizer is llama.cpp's Q4_1 reference (the embedded GGUF's own codes come back), the C
kernel equals the torch reference of its arithmetic (activations rounded to 8-bit blocks,
integer block dot products), and Q4Linear takes the kernel up to its rows and torch's
product above."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvserve.config import LoadConfig
from kvserve.errors import ParameterError
from kvserve.models.q4_linear import (
    Q4Linear,
    dequantize_q4,
    q4_reference,
    quantize_q4,
    quantize_rows_q8,
    unpack_q4,
)
from kvserve.models.quantized_linear import Q8Linear, quantize_linear_layers
from kvserve.native import ops

needs_kernels = pytest.mark.skipif(not ops.available(), reason="no native library here")


def _weight(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


def test_quantize_q4_is_min_max_blocks_with_codes_in_input_order():
    w = _weight(3, 64)
    codes, scales, mins = quantize_q4(w)
    assert codes.shape == (3, 32) and codes.dtype == torch.uint8
    blocks = w.view(3, 2, 32)
    assert torch.equal(mins, blocks.amin(-1))
    assert torch.allclose(scales, (blocks.amax(-1) - blocks.amin(-1)) / 15)
    values = unpack_q4(codes).view(3, 2, 32).long()
    assert values.amin(-1).eq(0).all() and values.amax(-1).eq(15).all()
    # input j of a block in byte j's low nibble, input j + 16 in its high nibble
    assert int(codes[0, 0]) == int(values[0, 0, 0]) | (int(values[0, 0, 16]) << 4)
    error = (dequantize_q4(codes, scales, mins) - w).abs()
    assert (error <= scales.repeat_interleave(32, dim=1) / 2 + 1e-6).all()
    with pytest.raises(ValueError, match="whole blocks of 32"):
        quantize_q4(_weight(2, 48))


def test_the_embedded_ggufs_q4_1_blocks_come_back_from_its_dequantized_weights():
    """Every block of the embedded model's Q4_1 tensors uses codes 0 and 15 (llama.cpp's
    reference quantizer), so quantizing the dequantized weight gives the file's own codes, its
    minimum exactly and its scale to float32 rounding."""
    from gguf.quants import dequantize

    from kvserve.formats.gguf_metadata import open_gguf
    from kvserve.models.paths import embedded_model_path

    reader = open_gguf(embedded_model_path())
    tensor = next(t for t in reader.tensors if t.name == "blk.3.ffn_down.weight")
    assert tensor.tensor_type.name == "Q4_1"
    raw = np.asarray(tensor.data).reshape(-1, 20)
    file_scales = torch.from_numpy(raw[:, 0:2].copy().view(np.float16).astype(np.float32))
    file_mins = torch.from_numpy(raw[:, 2:4].copy().view(np.float16).astype(np.float32))
    weight = dequantize(tensor.data, tensor.tensor_type)
    weight = torch.from_numpy(weight.reshape(int(tensor.shape[1]), int(tensor.shape[0])))
    codes, scales, mins = quantize_q4(weight)
    assert torch.equal(codes.view(-1, 16), torch.from_numpy(raw[:, 4:].copy()))
    assert torch.equal(mins.reshape(-1), file_mins.reshape(-1))
    assert torch.allclose(scales.reshape(-1), file_scales.reshape(-1), rtol=1e-6, atol=0)


def test_rows_rounded_to_8_bit_blocks():
    x = torch.tensor([[0.0] * 32 + [1.0, -2.0, 0.5] + [0.0] * 29])
    codes, scales = quantize_rows_q8(x)
    assert scales.tolist() == [[0.0, pytest.approx(2.0 / 127)]]
    assert codes[0, 0].eq(0).all()
    assert codes[0, 1, :3].tolist() == [64, -127, 32]  # 63.5 -> 64 (nearest even), 31.75 -> 32


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize(("out_features", "bias"), [(96, True), (37, False)])
def test_the_kernel_equals_its_torch_reference(rows, out_features, bias):
    """Row tiles of 1-4 and the one-row path's groups of four columns with a tail (37)."""
    w, x = _weight(out_features, 192), _weight(rows, 192, seed=1)
    b = _weight(1, out_features, seed=2)[0] if bias else None
    codes, scales, mins = quantize_q4(w)
    out = torch.empty(rows, out_features)
    assert ops.kernels().linear_q4(x, codes, scales, mins, b, out)
    want = q4_reference(x, codes, scales, mins, b)
    assert torch.allclose(out, want, rtol=1e-5, atol=1e-4)
    # and close to the float product of the dequantized weight: only x's rounding differs
    exact = x @ dequantize_q4(codes, scales, mins).T + (0 if b is None else b)
    assert (out - exact).abs().max() < 0.05 * exact.abs().max()


@needs_kernels
def test_the_kernel_declines_what_it_does_not_take():
    kernels = ops.kernels()
    codes, scales, mins = quantize_q4(_weight(8, 64))
    assert not kernels.linear_q4(_weight(65, 64), codes, scales, mins, None, torch.empty(65, 8))
    with pytest.raises(ValueError, match="linear_q4_f32"):
        kernels.linear_q4(_weight(1, 64), codes, scales[:, :1], mins, None, torch.empty(1, 8))


@needs_kernels
def test_q4_linear_takes_the_kernel_up_to_its_rows_and_torch_above():
    w = _weight(40, 64)
    layer = Q4Linear(w, None, kernel_rows=4, keep_float=True)
    few, many = _weight(4, 64, seed=3), _weight(5, 64, seed=4)
    codes, scales, mins = layer.codes, layer.scales, layer.mins
    assert torch.allclose(layer(few), q4_reference(few, codes, scales, mins), atol=1e-4)
    assert torch.equal(layer(many), F.linear(many, w))  # the kept float weight
    dequantizing = Q4Linear(w, None, kernel_rows=4, keep_float=False)
    assert dequantizing.weight is None
    assert torch.allclose(dequantizing(many), F.linear(many, layer.dequantized()), atol=1e-5)


def test_int4_layers_keep_8_bit_blocks_where_inputs_are_not_whole_blocks():
    model = torch.nn.Sequential(torch.nn.Linear(64, 8), torch.nn.Linear(40, 8))
    assert quantize_linear_layers(model, 8, keep_float=False, bits=4) == 2
    assert isinstance(model[0], Q4Linear) and isinstance(model[1], Q8Linear)


def test_int4_weights_are_refused_with_tensor_parallel_ranks():
    with pytest.raises(ParameterError, match="int4 weights are not sharded"):
        LoadConfig(weight_dtype="int4", tensor_parallel_size=2)
