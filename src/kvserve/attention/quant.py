"""8-bit KV cache formats: quantize on write, dequantize on read (torch, so not in kv/).

Granularity: int8 and fp8_e4m3 keep one float32 scale per (token, kv head).  A token's K row
can have outliers in a few channels (RoPE'd keys do) and per-tensor scales would let one
outlier token flatten every other token's resolution; per (token, head) costs 4 bytes per
64-128 values (3-6%) and is written together with the token, so no scale ever changes after
it is stored (a per-block or per-tensor scale would need re-quantizing old tokens).
fp8_e5m2 has fp16's exponent range and is stored unscaled.
"""

from __future__ import annotations

import torch

INT8_MAX = 127.0
FP8_E4M3_MAX = 448.0
FP8_E5M2_MAX = 57344.0
_MIN_SCALE = 1e-12

QUANTIZED_DTYPES = ("fp8_e4m3", "fp8_e5m2", "int8")
SCALED_DTYPES = ("fp8_e4m3", "int8")

FP8_TORCH_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
STORAGE_TORCH_DTYPE = {"fp8_e4m3": torch.uint8, "fp8_e5m2": torch.uint8, "int8": torch.int8}


def storage_dtype(kv_dtype: str) -> torch.dtype:
    """Torch dtype of the cache tensor.  fp8 is stored as raw bytes (uint8) because indexed
    writes into float8 tensors are not implemented on every device; it is viewed back on read."""
    if kv_dtype in STORAGE_TORCH_DTYPE:
        return STORAGE_TORCH_DTYPE[kv_dtype]
    return getattr(torch, kv_dtype)


def quantize(x: torch.Tensor, kv_dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [tokens, heads, dim] -> (data in storage dtype, scale [tokens, heads] float32 or None)."""
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
    raise ValueError(f"not an 8-bit KV dtype: {kv_dtype!r}")


def dequantize(
    data: torch.Tensor, scale: torch.Tensor | None, kv_dtype: str, out_dtype: torch.dtype
) -> torch.Tensor:
    """Inverse of quantize: data [..., dim] (+ scale [...]) -> values in out_dtype."""
    if kv_dtype in FP8_TORCH_DTYPES:
        values = data.view(FP8_TORCH_DTYPES[kv_dtype]).to(torch.float32)
    else:
        values = data.to(torch.float32)
    if scale is not None:
        values = values * scale[..., None]
    return values.to(out_dtype)
