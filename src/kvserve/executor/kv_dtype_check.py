"""Start-up check of a quantized (8- or 4-bit) KV cache: a canary text through the quantized and
the full-precision cache, compared logit by logit, before the engine commits to the dtype.

The canary (CANARY_TEXT, about 300 tokens) is prefilled in chunks of CANARY_CHUNK tokens, so
every chunk after the first attends over K/V read back from the cache (quantized on write,
dequantized on read); the positions of those chunks are compared with the same run through a
cache of the model's own dtype (`auto`).  One line is logged:

    KV cache dtype check: int8 vs float32 over 266 positions: largest logit difference 0.21,
    top-1 agreement 100.0% (minimum 90.0%): pass

Below --kv-cache-dtype-check-min-agreement the other quantized dtypes are tried, and the engine
refuses to start naming the best one that passes (`auto` when none does), or, with
--kv-cache-dtype-check fallback, logs that and uses it.  The default minimum is measured on the
embedded model (docs/prefix_cache.md).  It runs in the Worker (executor/worker.py), on every
tensor-parallel rank at once: the canary is a forward pass like any other, collectives included.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvserve.config import CacheConfig, ModelConfig
from kvserve.errors import ParameterError
from kvserve.kv.spec import kv_cache_spec, resolve_kv_dtype
from kvserve.kv_quant import QUANTIZED_DTYPES
from kvserve.native import platform
from kvserve.runner.paged_forward import allocate_paged_cache, chunked_prefill_logits

logger = logging.getLogger("kvserve")

CANARY_CHUNK = 32
CANARY_TEXT = (
    "The harbour town wakes before the sun. Fishermen check their nets by lantern light, "
    "counting the knots their fathers taught them to tie, while the baker on the corner pulls "
    "the first loaves from an oven that has not gone cold in forty years. By six o'clock the "
    "market square is loud with crates of mackerel, baskets of apples from the hill farms, and "
    "the argument, renewed every morning, about whether the new pier will ever be finished. "
    "Children run between the stalls with bread in their hands. The schoolteacher, who keeps a "
    "notebook of the weather going back to her first year in the town, writes that the wind "
    "has turned to the north-east and that the swallows left a week early. In the afternoon the "
    "tide goes out so far that the old wreck shows its ribs, and visitors walk out across the "
    "wet sand to photograph it, never quite believing the warnings about how quickly the water "
    "returns. At dusk the lighthouse keeper climbs the hundred and twelve steps, trims the "
    "wick out of habit although the lamp has been electric since before he was born, and "
    "watches the boats come home one by one, each of them named after somebody's mother, "
    "daughter or lost friend. Later, in the one pub that stays open past ten, the same three "
    "men play dominoes, the same dog sleeps by the fire, and someone tells again the story of "
    "the winter the whole bay froze and a horse and cart crossed from the quay to the island."
)


@dataclass(frozen=True)
class CanaryResult:
    kv_dtype: str  # resolved storage dtype
    reference_dtype: str
    num_positions: int
    max_logit_diff: float
    agreement: float  # share of positions whose top-1 token is the reference's

    def line(self, min_agreement: float) -> str:
        verdict = "pass" if self.agreement >= min_agreement else "FAIL"
        return (
            f"KV cache dtype check: {self.kv_dtype} vs {self.reference_dtype} over "
            f"{self.num_positions} positions: largest logit difference "
            f"{self.max_logit_diff:.3f}, top-1 agreement {self.agreement:.1%} "
            f"(minimum {min_agreement:.1%}): {verdict}"
        )


def canary_token_ids(tokenizer: object) -> list[int]:
    """CANARY_TEXT's tokens (the engine's tokenizer; every rank gets the same ids)."""
    return tokenizer.encode(CANARY_TEXT, add_special_tokens=False)


def wants_check(cache: CacheConfig) -> bool:
    """Whether `check_kv_cache_dtype` runs a canary for this config (an 8-bit KV dtype with
    the check on)."""
    asked = resolve_kv_dtype(cache.kv_cache_dtype, "")
    return cache.kv_cache_dtype_check != "off" and asked in QUANTIZED_DTYPES


class Canary:
    """The canary's reference logits, computed once, and the comparison of any KV dtype
    (each computed once).  `config` is the model's own shape: a tensor-parallel rank's
    (its KV heads) for a shard, whose logits are all-gathered, so every rank compares the
    same numbers and reaches the same verdict."""

    def __init__(
        self,
        model: torch.nn.Module,
        config: ModelConfig,
        token_ids: list[int],
        model_dtype: torch.dtype,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model, self.config = model, config
        self.token_ids = token_ids
        self.model_dtype = platform.dtype_name(model_dtype)
        self.block_size, self.device = block_size, device
        self.reference = self._logits("auto")[CANARY_CHUNK:]
        self._results: dict[str, CanaryResult] = {}

    def _logits(self, kv_dtype: str) -> torch.Tensor:
        c = self.config
        spec = kv_cache_spec(
            c.num_layers, c.num_kv_heads, c.head_dim, kv_dtype, self.model_dtype, self.block_size
        )
        num_blocks = spec.num_blocks_for_tokens(len(self.token_ids))
        cache = allocate_paged_cache(spec, num_blocks, self.device)
        return chunked_prefill_logits(self.model, cache, self.token_ids, CANARY_CHUNK, self.device)

    def compare(self, kv_dtype: str) -> CanaryResult:
        resolved = resolve_kv_dtype(kv_dtype, self.model_dtype)
        if resolved not in self._results:
            logits = self._logits(resolved)[CANARY_CHUNK:]
            same = logits.argmax(-1) == self.reference.argmax(-1)
            self._results[resolved] = CanaryResult(
                kv_dtype=resolved,
                reference_dtype=self.model_dtype,
                num_positions=len(same),
                max_logit_diff=float((logits - self.reference).abs().max()),
                agreement=float(same.float().mean()),
            )
        return self._results[resolved]


def check_kv_cache_dtype(cache: CacheConfig, make_canary: Callable[[], Canary]) -> str:
    """The --kv-cache-dtype to use: the one asked for, or (fallback) one that passes.
    ParameterError naming --kv-cache-dtype when it fails and the mode is `refuse`.
    `make_canary` is called only when an 8-bit dtype is to be checked."""
    asked = cache.kv_cache_dtype
    if not wants_check(cache):
        return asked
    canary = make_canary()
    minimum = cache.kv_cache_dtype_check_min_agreement
    result = canary.compare(asked)
    logger.info(result.line(minimum))
    if result.agreement >= minimum:
        return asked
    alternative, why = _passing_alternative(canary, result.kv_dtype, minimum)
    message = (
        f"{asked} fails the start-up check: top-1 agreement {result.agreement:.1%} with a "
        f"{result.reference_dtype} cache is below {minimum:.1%} "
        f"(--kv-cache-dtype-check-min-agreement); {alternative} passes ({why})"
    )
    if cache.kv_cache_dtype_check == "refuse":
        raise ParameterError(
            "--kv-cache-dtype",
            f"{message}: use --kv-cache-dtype {alternative}, or --kv-cache-dtype-check "
            "fallback to switch to it automatically (off skips the check)",
        )
    logger.warning("KV cache dtype check: %s: using --kv-cache-dtype %s instead", message,
                   alternative)  # fmt: skip
    return alternative


def _passing_alternative(canary: Canary, failed: str, minimum: float) -> tuple[str, str]:
    """The other 8-bit dtype with the best agreement among those that pass, else `auto`."""
    results = [canary.compare(d) for d in QUANTIZED_DTYPES if d != failed]
    for result in results:
        logger.info(result.line(minimum))
    passing = [r for r in results if r.agreement >= minimum]
    if not passing:
        return "auto", f"the model's own dtype, {canary.model_dtype}, is the reference"
    best = max(passing, key=lambda r: (r.agreement, -r.max_logit_diff))
    return best.kv_dtype, f"top-1 agreement {best.agreement:.1%}"
