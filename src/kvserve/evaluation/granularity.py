"""Why one scale per (token, kv head): quantization error of real K/V at several granularities.

The K/V of a text are captured from the model through a float32 paged cache (exactly what the
cache would store), then quantized and dequantized with one scale per

    tensor        one scale per layer for all tokens and heads (a static per-tensor scale)
    head          one scale per kv head for all tokens
    token         one scale per token for all heads
    token, head   one scale per (token, kv head): kv_quant.py's choice

or with no scale at all (fp8 e4m3 at scale 1.0, e5m2), and the error is reported relative to
the values' RMS: over the whole layer, and for the worst token (where coarse scales hurt:
a token whose values are small next to the group's maximum keeps few significant levels).
A scale must be fixed when its token is written (old tokens are never re-quantized), so
granularities coarser than the token are shown with the scale taken from the whole text,
i.e. their *best* case.

    python -m kvserve.evaluation.granularity --text ref.txt [--num-tokens 2048]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve import kv_quant as quant
from kvserve.evaluation.paged import Piece, allocate_cache, forward_hidden
from kvserve.kv.spec import cdiv

# Dimensions of a [tokens, heads, dim] tensor that share one scale.
GRANULARITIES = {
    "tensor": (0, 1, 2),
    "head": (0, 2),
    "token": (1, 2),
    "token, head": (2,),
}
SCALED_MAX = {"int8": quant.INT8_MAX, "fp8_e4m3": quant.FP8_E4M3_MAX}


@torch.inference_mode()
def capture_kv(
    model: torch.nn.Module, token_ids: list[int], block_size: int, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Prefill `token_ids` once through a float32 cache; per layer (K, V) [T, kv_heads, dim]
    as stored (K after RoPE).  The model may compute in any dtype."""
    num_blocks = cdiv(len(token_ids), block_size)
    cache = allocate_cache(model.config, "float32", torch.float32, block_size, num_blocks, device)
    table = list(range(num_blocks))
    forward_hidden(model, cache, [Piece("capture", token_ids, 0, table)], device)
    num_tokens = len(token_ids)
    return [
        (
            layer.key.flatten(0, 1)[:num_tokens].clone(),
            layer.value.flatten(0, 1)[:num_tokens].clone(),
        )
        for layer in cache.layers
    ]


def fake_quantize(
    x: torch.Tensor, kv_dtype: str, shared_dims: tuple[int, ...] | None
) -> torch.Tensor:
    """Quantize and dequantize x [T, heads, dim] with one scale per group of `shared_dims`,
    or at scale 1.0 when None (fp8_e5m2 always: it is stored unscaled)."""
    if kv_dtype == "fp8_e5m2":
        data, _ = quant.quantize(x, kv_dtype)
        return quant.dequantize(data, None, kv_dtype, torch.float32)
    x32 = x.float()
    if shared_dims is None:
        scale = torch.ones((), device=x.device)
    else:
        amax = x32.abs().amax(dim=shared_dims, keepdim=True)
        scale = (amax / SCALED_MAX[kv_dtype]).clamp(min=1e-12)
    scaled = x32 / scale
    if kv_dtype == "int8":
        values = torch.round(scaled).clamp(-quant.INT8_MAX, quant.INT8_MAX)
    else:
        values = scaled.clamp(-quant.FP8_E4M3_MAX, quant.FP8_E4M3_MAX)
        values = values.to(torch.float8_e4m3fn).float()
    return values * scale


def relative_rms_error(x: torch.Tensor, approx: torch.Tensor) -> float:
    """RMS of the error over RMS of the values, over the whole tensor."""
    x32 = x.float()
    return float((approx.float() - x32).pow(2).mean().sqrt() / x32.pow(2).mean().sqrt())


def worst_token_error(x: torch.Tensor, approx: torch.Tensor) -> float:
    """The largest relative RMS error of one token (over its heads and dims), x [T, H, D]."""
    x32 = x.float().flatten(1)
    err = (approx.float().flatten(1) - x32).pow(2).mean(1).sqrt()
    return float((err / x32.pow(2).mean(1).sqrt().clamp(min=1e-12)).max())


@dataclass(frozen=True)
class GranularityRow:
    kv_dtype: str
    granularity: str
    key_error: float  # relative RMS error, mean over layers
    value_error: float
    key_worst_token: float  # worst token's relative RMS error, max over layers
    value_worst_token: float
    scale_bytes_per_token: int  # per layer, K and V together, float32 scales


def granularity_table(kv: list[tuple[torch.Tensor, torch.Tensor]]) -> list[GranularityRow]:
    """Errors of K and V for int8 and fp8_e4m3 at each granularity, and the unscaled fp8s."""
    num_heads = kv[0][0].shape[1]
    cases: list[tuple[str, str, tuple[int, ...] | None]] = [
        (kv_dtype, name, dims)
        for kv_dtype in ("int8", "fp8_e4m3")
        for name, dims in GRANULARITIES.items()
    ]
    cases += [("fp8_e4m3", "none (scale 1.0)", None), ("fp8_e5m2", "none", None)]
    rows = []
    for kv_dtype, name, dims in cases:
        scale_bytes = {"token": 2 * 4, "token, head": 2 * 4 * num_heads}.get(name, 0)
        errors = _errors(kv, kv_dtype, dims)
        rows.append(GranularityRow(kv_dtype, name, *errors, scale_bytes))
    return rows


def _errors(kv, kv_dtype: str, dims: tuple[int, ...] | None) -> tuple[float, ...]:
    """(mean K error, mean V error, worst K token, worst V token) over layers."""
    mean_k, mean_v, worst_k, worst_v = [], [], [], []
    for k, v in kv:
        k_hat, v_hat = fake_quantize(k, kv_dtype, dims), fake_quantize(v, kv_dtype, dims)
        mean_k.append(relative_rms_error(k, k_hat))
        mean_v.append(relative_rms_error(v, v_hat))
        worst_k.append(worst_token_error(k, k_hat))
        worst_v.append(worst_token_error(v, v_hat))
    return sum(mean_k) / len(kv), sum(mean_v) / len(kv), max(worst_k), max(worst_v)


def format_table(rows: list[GranularityRow]) -> str:
    lines = [
        "| KV dtype | one scale per | K error | V error | worst-token K | worst-token V "
        "| scale bytes/token/layer |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.kv_dtype} | {r.granularity} | {100 * r.key_error:.2f}% "
            f"| {100 * r.value_error:.2f}% | {100 * r.key_worst_token:.2f}% "
            f"| {100 * r.value_worst_token:.2f}% | {r.scale_bytes_per_token} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from kvserve.config import EngineConfig, LoadConfig
    from kvserve.evaluation.kv_eval import load_model

    parser = argparse.ArgumentParser(prog="python -m kvserve.evaluation.granularity")
    parser.add_argument("model", nargs="?", default=None, help="Model path; default embedded.")
    parser.add_argument("--text", type=Path, required=True, help="UTF-8 text file.")
    parser.add_argument("--num-tokens", type=int, default=2048, help="Tokens to capture.")
    args = parser.parse_args(argv)
    loaded = load_model(EngineConfig(load=LoadConfig(model=args.model, dtype="float32")))
    token_ids = loaded.tokenizer.encode(args.text.read_text(encoding="utf-8"))
    kv = capture_kv(loaded.model, token_ids[: args.num_tokens], 16, loaded.device)
    print(format_table(granularity_table(kv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
