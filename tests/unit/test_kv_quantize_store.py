"""The one-pass C quantize-and-store (attention/csrc/kv_quantize.c) against kv_quant.py: the
same codes and scales, bit for bit, for every 8- and 4-bit dtype, from float32 and bfloat16 rows, in
contiguous and strided (a column slice of a fused QKV output) layouts, with tiny values
(fp8 subnormals), zeros, values past the formats' ranges and ties."""

from __future__ import annotations

import pytest
import torch

from kvserve import kv_quant as quant
from kvserve.attention.kv_cache import LayerKVCache
from kvserve.native import ops

pytestmark = pytest.mark.skipif(not ops.available(), reason="no C compiler here")


def rows(dtype: torch.dtype, strided: bool, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(37, 3, 64, generator=gen) * torch.logspace(-9, 5, 37)[:, None, None]
    x[3] = 0.0  # an all-zero row: the minimum scale
    x[4, 1, :8] = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 1e-7, -3e-9, 4e-8])  # ties, tiny
    x[5] = x[5].sign() * 70000.0  # past fp8_e5m2's range: clamped
    x = x.to(dtype)
    if strided:  # v as the model makes it: a view into wider rows
        wide = torch.zeros(37, 5 * 64, dtype=dtype)
        wide[:, 128:320] = x.reshape(37, 192)
        x = wide[:, 128:320].view(37, 3, 64)
        assert not x.is_contiguous()
    return x


def empty_cache(kv_dtype: str, num_slots: int, heads: int) -> LayerKVCache:
    store = quant.storage_dtype(kv_dtype)
    shape = (num_slots // 16, 16, heads, quant.stored_width(kv_dtype, 64))
    scaled = kv_dtype in quant.SCALED_DTYPES
    return LayerKVCache(
        torch.zeros(shape, dtype=store), torch.zeros(shape, dtype=store),
        torch.zeros(shape[:3]) if scaled else None, torch.zeros(shape[:3]) if scaled else None,
        kv_dtype,
    )  # fmt: skip


@pytest.mark.parametrize("kv_dtype", quant.ROW_FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("strided", [False, True])
def test_codes_and_scales_equal_the_torch_quantizer(kv_dtype, dtype, strided):
    gen = torch.Generator().manual_seed(11)
    x = rows(dtype, strided, gen)
    cache = empty_cache(kv_dtype, 160, 3)
    slots = torch.randperm(160, generator=gen)[:37]
    cache.write(slots, x, x)
    codes, scales = quant.quantize(x, kv_dtype)
    width = quant.stored_width(kv_dtype, 64)
    assert torch.equal(cache.key.view(-1, 3, width)[slots], codes)
    assert torch.equal(cache.value.view(-1, 3, width)[slots], codes)
    if scales is not None:
        assert torch.equal(cache.key_scale.view(-1, 3)[slots], scales)
    untouched = torch.ones(160, dtype=torch.bool)
    untouched[slots] = False
    assert not cache.key.view(-1, 3, width)[untouched].any()  # nothing else written


@pytest.mark.parametrize("kv_dtype", list(quant.FP8_TORCH_DTYPES))
def test_every_fp8_value_is_stored_as_torch_stores_it(kv_dtype):
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = values.view(quant.FP8_TORCH_DTYPES[kv_dtype]).float()
    values = values[values.isfinite()]
    x = values[: values.numel() // 64 * 64].view(-1, 1, 64)
    cache = empty_cache(kv_dtype, 16, 1)
    slots = torch.arange(x.shape[0])
    cache.write(slots, x, x)
    codes, _ = quant.quantize(x, kv_dtype)
    assert torch.equal(cache.key.view(-1, 1, 64)[slots], codes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("num_tokens", [37, 1200])  # 1,200: the multi-threaded copy
def test_a_cache_of_the_rows_dtype_stores_them_as_they_are(dtype, strided, num_tokens):
    """The C copy store (csrc/attention/kv_quantize.c kv_copy_store), which replaced index_copy_ for
    unquantized caches: every row lands in its slot unchanged, nothing else is written."""
    from kvserve.attention.kv_cache import _store_rows_in_c

    gen = torch.Generator().manual_seed(num_tokens)
    wide = torch.randn(num_tokens, 5 * 64, generator=gen).to(dtype)
    x = wide[:, 128:320].view(num_tokens, 3, 64) if strided else wide[:, :192].view(-1, 3, 64)
    x = x if strided else x.contiguous()
    shape = (2 * num_tokens // 16 + 1, 16, 3, 64)
    cache = LayerKVCache(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype),
                         None, None, "auto")  # fmt: skip
    slots = torch.randperm(shape[0] * 16, generator=gen)[:num_tokens]
    assert _store_rows_in_c(x, cache.key.view(-1, 3, 64), slots)  # the C path applies
    cache.write(slots, x, -x)
    assert torch.equal(cache.key.view(-1, 3, 64)[slots], x)
    assert torch.equal(cache.value.view(-1, 3, 64)[slots], -x)
    untouched = torch.ones(shape[0] * 16, dtype=torch.bool)
    untouched[slots] = False
    assert not cache.key.view(-1, 3, 64)[untouched].any()


def test_int4_codes_are_nibbles_of_the_mid_rise_grid():
    """int4 by hand: scale = amax / 8, code = clamp(floor(x / scale) + 8, 0, 15), value 2j in
    byte j's low nibble; the C store writes exactly these bytes."""
    x = torch.tensor([8.0, -8.0, 0.0, -0.1, 7.9, 1.0] + [0.0] * 58).view(1, 1, 64)
    codes, scales = quant.quantize(x, "int4")
    assert scales.item() == 1.0
    # codes 15 (8 -> floor 8 + 8 = 16, clamped), 0, 8, 7, 15, 9
    assert codes[0, 0, :3].tolist() == [15 | 0 << 4, 8 | 7 << 4, 15 | 9 << 4]
    values = quant.dequantize(codes, scales, "int4", torch.float32)
    assert values[0, 0, :6].tolist() == [7.5, -7.5, 0.5, -0.5, 7.5, 1.5]
    cache = empty_cache("int4", 16, 1)
    cache.write(torch.tensor([5]), x, x)
    assert torch.equal(cache.key.view(-1, 1, 32)[5], codes[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("strided", [False, True])
def test_int4_keys_near_the_key_sink_are_stored_relative_to_it(dtype, strided):
    """Rows nearer the key sink than zero are quantized as row - sink under a negative scale,
    by the C store and kv_quant.py alike (codes and scales bit for bit); they read back as
    codes x |scale| + sink, several times nearer the row than its codes without the sink."""
    gen = torch.Generator().manual_seed(5)
    sink = torch.randn(3, 64, generator=gen) * 6
    x = rows(dtype, strided, gen)
    near = torch.zeros(37, 3, dtype=torch.bool)
    near[::3] = True
    noise = torch.randn(int(near.sum()), 64, generator=gen)
    x[near] = (sink.expand(37, 3, 64)[near] + noise).to(dtype)
    cache = empty_cache("int4", 160, 3)
    cache.key_sink = sink
    slots = torch.randperm(160, generator=gen)[:37]
    cache.write(slots, x, x)
    codes, scales = quant.quantize(x, "int4", sink)
    assert (scales[near] < 0).all() and (scales[~near] > 0).any()
    assert torch.equal(cache.key.view(-1, 3, 32)[slots], codes)
    assert torch.equal(cache.key_scale.view(-1, 3)[slots], scales)
    plain_codes, plain_scales = quant.quantize(x, "int4")  # values: no sink
    assert torch.equal(cache.value.view(-1, 3, 32)[slots], plain_codes)
    assert torch.equal(cache.value_scale.view(-1, 3)[slots], plain_scales)
    keys, _ = cache.gather(torch.arange(10), torch.float32)
    sinked_error = (keys[slots][near] - x.float()[near]).square().mean()
    plain = quant.dequantize(plain_codes, plain_scales, "int4", torch.float32)
    assert sinked_error * 5 < (plain[near] - x.float()[near]).square().mean()
    far = scales > 0  # the rows nearer zero than the sink: as without one
    torch.testing.assert_close(keys[slots][far], plain[far], atol=0, rtol=0)
