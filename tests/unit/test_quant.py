"""8-bit KV formats on random tensors: round-trip error bounds that follow from each format,
the cache tensors that store them, and the bytes the accounting charges for them.

Bounds (x a value, s its (token, head) scale, errors after quantize -> dequantize):
  int8      |err| <= s / 2 with s = absmax / 127, i.e. absmax / 254 (round to nearest;
            s is floored at 1e-12 for all-zero rows)
  fp8_e4m3  |err| <= 2^-4 |x| for |x / s| >= 2^-6 (3 mantissa bits, round to nearest),
            |err| <= 2^-10 s below it (subnormal spacing 2^-9, half of it)
  fp8_e5m2  |err| <= 2^-3 |x| for |x| >= 2^-14 (2 mantissa bits, no scale),
            |err| <= 2^-17 below it (subnormal spacing 2^-16)
The float32 divide and multiply around the rounding each add at most 2^-24 relative, so every
bound gets FLOAT_ERR x |x| = 2^-22 |x| on top (a value exactly halfway, e.g. x / s = -36.5,
needs it) and nothing more.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve import kv_quant as quant
from kvserve.attention.kv_cache import allocate_kv_caches, kv_cache_bytes
from kvserve.engine.sizing import size_kv_cache
from kvserve.kv.spec import kv_cache_spec

FLOAT_ERR = 2**-22
EMBEDDED = dict(num_layers=30, num_kv_heads=3, head_dim=64)  # SmolLM2-135M


def random_kv(seed: int, tokens: int = 64, heads: int = 3, dim: int = 64) -> torch.Tensor:
    """[tokens, heads, dim] with per-token magnitudes spread over 1e-4..1e3 and outliers."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, heads, dim, generator=gen)
    magnitude = 10 ** (torch.rand(tokens, 1, 1, generator=gen) * 7 - 4)
    x[:, :, dim // 2] *= 20  # an outlier channel, as RoPE'd keys have
    return x * magnitude


def round_trip(x: torch.Tensor, kv_dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    data, scale = quant.quantize(x, kv_dtype)
    return quant.dequantize(data, scale, kv_dtype, torch.float32), scale


def assert_int8_bound(x: torch.Tensor) -> None:
    out, scale = round_trip(x, "int8")
    amax = x.abs().amax(-1)
    torch.testing.assert_close(scale, (amax / 127).clamp(min=1e-12), rtol=0, atol=0)
    err = (out - x).abs()
    assert bool((err <= scale[..., None] / 2 + FLOAT_ERR * x.abs()).all()), err.max()


def assert_e4m3_bound(x: torch.Tensor) -> None:
    out, scale = round_trip(x, "fp8_e4m3")
    s = scale[..., None]
    bound = torch.maximum(x.abs() * 2**-4, s * 2**-10) + FLOAT_ERR * x.abs()
    assert bool(((out - x).abs() <= bound).all()), ((out - x).abs() / bound).max()


def assert_e5m2_bound(x: torch.Tensor) -> None:
    out, scale = round_trip(x, "fp8_e5m2")
    assert scale is None
    bound = torch.clamp(x.abs() * 2**-3, min=2**-17) + FLOAT_ERR * x.abs()
    assert bool(((out - x).abs() <= bound).all()), ((out - x).abs() / bound).max()


@pytest.mark.parametrize("seed", range(4))
def test_int8_error_is_at_most_half_a_step_of_each_token_heads_scale(seed):
    assert_int8_bound(random_kv(seed))


@pytest.mark.parametrize("seed", range(4))
def test_fp8_e4m3_error_is_relative_2_pow_minus_4_above_the_subnormal_floor(seed):
    assert_e4m3_bound(random_kv(seed))


@pytest.mark.parametrize("seed", range(4))
def test_fp8_e5m2_error_is_relative_2_pow_minus_3(seed):
    x = random_kv(seed)
    assert_e5m2_bound(x.clamp(-quant.FP8_E5M2_MAX, quant.FP8_E5M2_MAX))


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    exponent=st.floats(-6, 4),
    tokens=st.integers(1, 9),
    dim=st.sampled_from([1, 3, 64]),
)
def test_bounds_hold_at_any_magnitude(seed, exponent, tokens, dim):
    x = random_kv(seed, tokens, 2, dim) * 10**exponent
    assert_int8_bound(x)
    assert_e4m3_bound(x)
    assert_e5m2_bound(x.clamp(-quant.FP8_E5M2_MAX, quant.FP8_E5M2_MAX))


def test_the_token_head_absmax_is_stored_exactly_enough_and_zeros_stay_zero():
    x = torch.zeros(3, 2, 8)
    x[1, 0] = torch.linspace(-5, 7, 8)
    for kv_dtype in quant.ROW_FORMATS:
        out, _ = round_trip(x, kv_dtype)
        assert torch.isfinite(out).all()
        zeros = torch.cat((out[0], out[1, 1:], out[2]))
        if kv_dtype == "int4":  # mid-rise: no zero level, zeros come back as half a step
            assert zeros.abs().max().item() <= 0.5e-12  # of the smallest scale
            assert out[1, 0, -1].item() == 7.0 - 7.0 / 16  # the absmax: half a step of 7 / 8
            continue
        assert (zeros == 0).all()
        assert out[1, 0, -1].item() == pytest.approx(7.0, rel=1e-6)  # the absmax itself


def test_one_outlier_token_leaves_the_others_untouched():
    """The point of per-(token, head) scales: a token's error depends on its own values only."""
    x = random_kv(0, tokens=8)
    with_outlier = x.clone()
    with_outlier[3] *= 1e4
    for kv_dtype in quant.SCALED_DTYPES:
        alone, _ = round_trip(x, kv_dtype)
        beside, _ = round_trip(with_outlier, kv_dtype)
        others = [i for i in range(8) if i != 3]
        assert torch.equal(alone[others], beside[others])


def test_e5m2_saturates_instead_of_overflowing():
    x = torch.tensor([[[1e6, -1e6, 57344.0, 3.0]]])
    out, _ = round_trip(x, "fp8_e5m2")
    assert out.flatten().tolist() == [57344.0, -57344.0, 57344.0, 3.0]


def test_storage_dtypes_and_scale_shapes():
    x = random_kv(1, tokens=5)
    for kv_dtype, storage, scaled in (
        ("int8", torch.int8, True),
        ("fp8_e4m3", torch.uint8, True),
        ("fp8_e5m2", torch.uint8, False),
    ):
        data, scale = quant.quantize(x, kv_dtype)
        assert data.dtype == storage == quant.storage_dtype(kv_dtype)
        assert data.shape == x.shape
        assert (scale is not None) == scaled
        if scaled:
            assert scale.shape == (5, 3) and scale.dtype == torch.float32


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float32"])
def test_cache_write_then_gather_equals_the_round_trip(kv_dtype):
    spec = kv_cache_spec(2, 3, 8, kv_dtype, "float32", block_size=4)
    caches = allocate_kv_caches(spec, num_blocks=6, device=torch.device("cpu"))
    k, v = random_kv(2, tokens=7, dim=8), random_kv(3, tokens=7, dim=8)
    slots = torch.tensor([21, 4, 5, 6, 7, 0, 13])  # scattered over blocks 5, 1, 0, 3
    caches[0].write(slots, k, v)
    keys, values = caches[0].gather(torch.arange(6), torch.float32)
    assert keys.dtype == values.dtype == torch.float32 and keys.shape == (24, 3, 8)
    if kv_dtype in quant.QUANTIZED_DTYPES:
        expect_k, expect_v = round_trip(k, kv_dtype)[0], round_trip(v, kv_dtype)[0]
    else:
        expect_k, expect_v = (
            k.to(getattr(torch, kv_dtype)).float(),
            v.to(getattr(torch, kv_dtype)).float(),
        )
    assert torch.equal(keys[slots], expect_k) and torch.equal(values[slots], expect_v)
    untouched = [i for i in range(24) if i not in slots.tolist()]
    assert (keys[untouched] == 0).all()  # nothing written beyond the given slots
    assert (caches[1].key == 0).all()  # nor into another layer


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8", "fp8_e5m2", "int8"])
def test_allocated_bytes_equal_the_accounting(kv_dtype):
    spec = kv_cache_spec(**EMBEDDED, kv_cache_dtype=kv_dtype, model_dtype="bfloat16", block_size=16)
    caches = allocate_kv_caches(spec, num_blocks=3, device=torch.device("cpu"))
    assert kv_cache_bytes(caches) == 3 * spec.bytes_per_block


# Bytes per token of the embedded model: 2 (K, V) x 30 layers x 3 KV heads x (64 values x
# bytes per value + 4 scale bytes for the scaled 8-bit dtypes).
BYTES_PER_TOKEN = {
    ("auto", "float32"): 2 * 30 * 3 * 64 * 4,  # 46,080
    ("auto", "bfloat16"): 2 * 30 * 3 * 64 * 2,  # 23,040
    ("fp8", "float32"): 2 * 30 * 3 * (64 + 4),  # 12,240 (fp8 = fp8_e4m3)
    ("fp8_e4m3", "bfloat16"): 2 * 30 * 3 * (64 + 4),
    ("fp8_e5m2", "float32"): 2 * 30 * 3 * 64,  # 11,520: no scales
    ("int8", "bfloat16"): 2 * 30 * 3 * (64 + 4),  # 12,240
}


@pytest.mark.parametrize(("kv_dtype", "model_dtype"), list(BYTES_PER_TOKEN))
def test_bytes_per_token_of_the_embedded_model(kv_dtype, model_dtype):
    spec = kv_cache_spec(
        **EMBEDDED, kv_cache_dtype=kv_dtype, model_dtype=model_dtype, block_size=16
    )
    assert spec.bytes_per_token == BYTES_PER_TOKEN[kv_dtype, model_dtype]


def test_block_counts_at_one_kv_cache_memory():
    """--kv-cache-memory 96MiB, block size 16: blocks = budget // (16 x bytes per token)."""
    budget = 96 * 2**20
    blocks = {}
    for kv_dtype, model_dtype in BYTES_PER_TOKEN:
        spec = kv_cache_spec(
            **EMBEDDED, kv_cache_dtype=kv_dtype, model_dtype=model_dtype, block_size=16
        )
        blocks[kv_dtype, model_dtype] = size_kv_cache(spec, budget, max_model_len=512).num_blocks
    assert blocks == {
        ("auto", "float32"): 136,  # 100,663,296 // 737,280
        ("auto", "bfloat16"): 273,  # // 368,640
        ("fp8", "float32"): 514,  # // 195,840
        ("fp8_e4m3", "bfloat16"): 514,
        ("fp8_e5m2", "float32"): 546,  # // 184,320
        ("int8", "bfloat16"): 514,
    }
    # "About twice the blocks of a 16-bit cache": exactly 2x without scales, 2 x 64/68 with.
    assert blocks["fp8_e5m2", "float32"] == 2 * blocks["auto", "bfloat16"]
    assert 1.88 < blocks["int8", "bfloat16"] / blocks["auto", "bfloat16"] < 1.89
