"""8- and 4-bit KV cache formats: quantize on write, dequantize on read.

A module of its own: the attention backends, the KV dtype check, the evaluation and the
benchmarks all read these formats, and it needs torch, so kv/ (pure Python) cannot hold it.

Granularity: int8 and fp8_e4m3 keep one float32 scale per (token, kv head).  A token's K row
can have outliers in a few channels (RoPE'd keys do) and per-tensor scales would let one
outlier token flatten every other token's resolution; per (token, head) costs 4 bytes per
64-128 values (3-6%) and is written together with the token, so no scale ever changes after
it is stored (a per-block or per-tensor scale would need re-quantizing old tokens).
fp8_e5m2 has fp16's exponent range and is stored unscaled.

int4 keeps the same float32 scale per (token, kv head) and packs two 4-bit codes a byte (value
2j in byte j's low nibble, 2j + 1 in its high one): 36 bytes per 64 values, 3.56x fewer than
bfloat16. The grid is mid-rise, 16 levels (q - 7.5) x scale with q = clamp(floor(x / scale) +
8, 0, 15): no level is wasted on an exact zero. The scale is amax / d for the d of
INT4_SCALE_DIVISORS whose codes leave the row the least squared error: amax / 8 fits the
largest value, a larger d clips it and gives the many small ones finer steps, and which wins
differs from row to row (docs/decisions/kv-int4-rotation.md). A per-group scale (llama.cpp's
q4_0 keeps one per 32 values) would cost the bytes that make 3.5x; the rotation that comes with
int4 (attention/rotation.py) spreads a head's outliers over all its values instead, so one
scale per head fits them.

An int4 key cache may have a key sink per layer and head (runner/key_offsets.py): a key row
nearer the sink than zero is stored as row - sink, and its scale negated to say so; it reads
back as codes x |scale| + sink.  The first token's keys (the attention sink, which most
queries weigh heavily) lie far from the others and alike from one text to the next: relative to
the sink their 4-bit rounding is small, and with it the error of the scores that decide how much
every query attends them.
"""

from __future__ import annotations

import torch

INT8_MAX = 127.0
FP8_E4M3_MAX = 448.0
FP8_E5M2_MAX = 57344.0
_MIN_SCALE = 1e-12

INT4_LEVELS_HALF = 8.0  # codes 0..15 stand for -7.5 .. 7.5 steps
# A 4-bit row's candidate scales amax / d, tried in this order (the first of equal errors
# wins); exact in binary, so that the C quantizer divides by the same float32 values.
INT4_SCALE_DIVISORS = (8.0, 8.5, 9.0, 9.5, 10.0, 10.5)

# The formats of a row (quantize / dequantize), and the cache dtypes built on them: k8v4 keeps
# int8 keys and int4 values (config.SPLIT_KV_DTYPES).
ROW_FORMATS = ("fp8_e4m3", "fp8_e5m2", "int8", "int4")
QUANTIZED_DTYPES = (*ROW_FORMATS, "k8v4")
SCALED_DTYPES = ("fp8_e4m3", "int8", "int4")  # row formats with a scale per row
PACKED_DTYPES = ("int4",)  # two codes a byte: the cache's last dim is head_dim / 2
ROTATED_DTYPES = ("int4", "k8v4")  # rows stored rotated (attention/rotation.py)
# What a rotated cache's rows hold, in the prefix store's fingerprint: rows stored under
# another version do not read back (1: rotated, mean keys out; 2: keys' channels scaled too;
# 3: int4 keys near the key sink stored relative to it).
ROTATED_ROWS_VERSION = "3"

FP8_TORCH_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
STORAGE_TORCH_DTYPE = {
    "fp8_e4m3": torch.uint8, "fp8_e5m2": torch.uint8, "int8": torch.int8, "int4": torch.uint8,
}  # fmt: skip


def stored_width(kv_dtype: str, head_dim: int) -> int:
    """Elements of the cache's last dimension for one head: head_dim, or half (int4)."""
    return head_dim // 2 if kv_dtype in PACKED_DTYPES else head_dim


def storage_dtype(kv_dtype: str) -> torch.dtype:
    """Torch dtype of the cache tensor.  fp8 is stored as raw bytes (uint8) because indexed
    writes into float8 tensors are not implemented on every device; it is viewed back on read."""
    if kv_dtype in STORAGE_TORCH_DTYPE:
        return STORAGE_TORCH_DTYPE[kv_dtype]
    return getattr(torch, kv_dtype)


def quantize(
    x: torch.Tensor, kv_dtype: str, key_sink: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [tokens, heads, dim] -> (data in storage dtype, scale [tokens, heads] float32 or None).
    `key_sink` [heads, dim] (int4 keys alone): rows nearer it than zero stored relative to it,
    under negative scales (this module's docstring)."""
    if kv_dtype == "fp8_e5m2":
        data = x.float().clamp(-FP8_E5M2_MAX, FP8_E5M2_MAX).to(torch.float8_e5m2)
        return data.view(torch.uint8), None
    x32 = x.float()
    amax = x32.abs().amax(dim=-1)
    if kv_dtype == "int8":
        scale = (amax / INT8_MAX).clamp(min=_MIN_SCALE)
        data = torch.round(x32 / scale[..., None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
        return data, scale
    if kv_dtype == "fp8_e4m3":
        scale = (amax / FP8_E4M3_MAX).clamp(min=_MIN_SCALE)
        data = (x32 / scale[..., None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
        return data.to(torch.float8_e4m3fn).view(torch.uint8), scale
    if kv_dtype == "int4":
        if key_sink is None:
            codes, scale = _int4_codes(x32, amax)
            return pack_nibbles(codes.to(torch.uint8)), scale
        sink = key_sink.to(torch.float32)
        x64, sink64 = x32.double(), sink.double()
        near = (x64 - sink64).square().sum(-1) < x64.square().sum(-1)
        x32 = torch.where(near[..., None], x32 - sink, x32)
        codes, scale = _int4_codes(x32, x32.abs().amax(dim=-1))
        return pack_nibbles(codes.to(torch.uint8)), torch.where(near, -scale, scale)
    raise ValueError(f"not a quantized KV dtype: {kv_dtype!r}")


def _int4_codes(x32: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's codes (float32, 0..15) and scale under the INT4_SCALE_DIVISORS candidate
    whose dequantized row is nearest x32 in squared error, summed in float64 (as
    kv_quantize.c does: (code - 7.5) x scale is exact there, so only the order of the sum
    differs)."""
    best_codes = best_scale = best_error = None
    x64 = x32.double()
    for divisor in INT4_SCALE_DIVISORS:
        scale = (amax / divisor).clamp(min=_MIN_SCALE)
        codes = (torch.floor(x32 / scale[..., None]) + INT4_LEVELS_HALF).clamp(0, 15)
        diff = (codes.double() - (INT4_LEVELS_HALF - 0.5)) * scale.double()[..., None] - x64
        error = diff.square().sum(-1)
        if best_error is None:
            best_codes, best_scale, best_error = codes, scale, error
            continue
        better = error < best_error
        best_codes = torch.where(better[..., None], codes, best_codes)
        best_scale = torch.where(better, scale, best_scale)
        best_error = torch.where(better, error, best_error)
    return best_codes, best_scale


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """codes [..., dim] in 0..15 (uint8) -> [..., dim / 2] bytes, code 2j in byte j's low
    nibble and 2j + 1 in its high one."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(data: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_nibbles: [..., dim / 2] bytes -> codes [..., dim] uint8."""
    return torch.stack((data & 15, data >> 4), dim=-1).flatten(-2)


def dequantize(
    data: torch.Tensor,
    scale: torch.Tensor | None,
    kv_dtype: str,
    out_dtype: torch.dtype,
    key_sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """Inverse of quantize: data [..., heads, dim] (+ scale [..., heads]) -> values in
    out_dtype; `key_sink` [heads, dim] as quantize was given it (int4 keys)."""
    if kv_dtype in FP8_TORCH_DTYPES:
        values = data.view(FP8_TORCH_DTYPES[kv_dtype]).to(torch.float32)
    elif kv_dtype == "int4":
        values = unpack_nibbles(data).to(torch.float32) - (INT4_LEVELS_HALF - 0.5)
    else:
        values = data.to(torch.float32)
    if key_sink is not None and kv_dtype == "int4":
        assert scale is not None
        relative = (scale < 0)[..., None]
        values = values * scale.abs()[..., None] + relative * key_sink.to(torch.float32)
    elif scale is not None:
        values = values * scale[..., None]
    return values.to(out_dtype)
