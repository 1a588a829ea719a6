"""Sampler: [B, vocab] logits -> [B] token ids, with per-request parameters.

Host side (``SamplingBatch.build``) turns per-request parameters into tensors once per step;
device side (``sample``) is vectorized over the batch.  Random rows sample by inverting their
cumulative distribution at one uniform draw each, which is exact for the categorical
distribution and lets each seeded request draw from its own generator: a seeded request's
tokens do not depend on what else shares its batch.  One draw a row, not one a vocabulary
entry: the exponential race (argmax of p / E, E ~ Exp(1)) drew 49,152 values a row, and on a
CPU `exponential_` took 135 ms for 128 rows, more than the decode step it sampled for.  Top-k
finds its threshold with `topk` and top-p by selection on mass (csrc/top_p_rows.c on a CPU),
not by sorting the vocabulary (277 ms at [128, 49,152]).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvserve.request import SamplingParams


@dataclass
class SamplingBatch:
    temperature: torch.Tensor  # [B] float32, 1.0 for greedy rows (unused there)
    top_k: torch.Tensor  # [B] int64, vocab size when disabled
    top_p: torch.Tensor  # [B] float32
    min_p: torch.Tensor  # [B] float32
    greedy: torch.Tensor  # [B] bool
    generators: list[torch.Generator | None]  # per row; None: the shared generator
    banned: list[tuple[int, list[int]]]  # (row, token ids) masked for min_tokens
    num_logprobs: list[int | None]  # per row
    all_greedy: bool
    needs_top_k: bool
    needs_top_p: bool
    needs_min_p: bool

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        banned: list[tuple[int, list[int]]],
        vocab_size: int,
        device: torch.device,
    ) -> SamplingBatch:
        top_k = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params]
        return cls(
            temperature=torch.tensor(
                [1.0 if p.greedy else p.temperature for p in params], device=device
            ),
            top_k=torch.tensor(top_k, dtype=torch.long, device=device),
            top_p=torch.tensor([p.top_p for p in params], device=device),
            min_p=torch.tensor([p.min_p for p in params], device=device),
            greedy=torch.tensor([p.greedy for p in params], device=device),
            generators=generators,
            banned=banned,
            num_logprobs=[p.logprobs for p in params],
            all_greedy=all(p.greedy for p in params),
            needs_top_k=any(k < vocab_size for k in top_k),
            needs_top_p=any(p.top_p < 1.0 for p in params),
            needs_min_p=any(p.min_p > 0.0 for p in params),
        )


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B]
    logprobs: torch.Tensor | None  # [B, vocab] raw log-softmax, when any row asked for it


def sample(
    logits: torch.Tensor, batch: SamplingBatch, generator: torch.Generator | None = None
) -> SamplerOutput:
    """logits [B, vocab] (float32, or the model's dtype) -> sampled token ids [B].

    Greedy rows with nothing to mask or report take the argmax of the logits as they are: a
    bfloat16 value widens to float32 exactly, so the index is the one float32 logits give."""
    wants_logprobs = any(n is not None for n in batch.num_logprobs)
    if batch.all_greedy and not batch.banned and not wants_logprobs:
        return SamplerOutput(_argmax(logits), None)
    logits = logits.float()  # a copy unless already float32; masked in place below
    for row, token_ids in batch.banned:
        logits[row, token_ids] = float("-inf")
    logprobs = None
    if wants_logprobs:
        logprobs = torch.log_softmax(logits, dim=-1)
    greedy_ids = _argmax(logits)
    if batch.all_greedy:
        return SamplerOutput(greedy_ids, logprobs)
    probs = _filtered_probs(logits / batch.temperature[:, None], batch)
    uniforms = _uniforms(probs.shape[0], probs.device, batch.generators, generator)
    random_ids = _inverse_cdf(probs, uniforms)
    return SamplerOutput(torch.where(batch.greedy, greedy_ids, random_ids), logprobs)


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """Index of each row's maximum (the first on a tie, the first NaN if any, as torch).  On a
    CPU through csrc/argmax_rows.c (float32 or bfloat16 rows, ~10x faster than torch at
    [128, 49,152]); elsewhere `max(dim).indices`, the same result 3-4x faster than `argmax`
    on a CPU, where argmax is not vectorized."""
    if x.device.type == "cpu" and x.dim() == 2 and x.dtype in _ARGMAX_KINDS and x.numel():
        kernel = _argmax_kernel()
        if kernel is not None and x.stride(1) == 1:
            out = torch.empty(x.shape[0], dtype=torch.int64)
            kernel(x.data_ptr(), _ARGMAX_KINDS[x.dtype], x.shape[0], x.shape[1], x.stride(0),
                   out.data_ptr(), torch.get_num_threads())  # fmt: skip
            return out
    return x.max(dim=-1).indices


_ARGMAX_KINDS = {torch.float32: 0, torch.bfloat16: 1}


@functools.cache
def _argmax_kernel() -> Callable[..., int] | None:
    from kvserve.attention.cpu_kernels import kernels_or_none

    kernels = kernels_or_none()
    return None if kernels is None else kernels.argmax_rows


def _filtered_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Softmax after top-k, top-p and min-p filtering (each only when some row uses it)."""
    if batch.needs_top_k:
        logits = _top_k_filtered(logits, batch.top_k)
    if batch.needs_top_p:
        logits = _top_p_filtered(logits, batch.top_p)
    probs = logits.softmax(dim=-1)
    if batch.needs_min_p:
        threshold = probs.amax(dim=-1, keepdim=True) * batch.min_p[:, None]
        probs = probs.masked_fill(probs < threshold, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _top_k_filtered(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Logits below each row's k-th largest set to -inf (ties with it kept); rows whose top_k
    is the vocabulary size are left whole.  `topk` to the largest k asked for, not a sort."""
    vocab = logits.shape[1]
    filtered = top_k < vocab
    largest_k = int(top_k[filtered].max())
    kth = logits.topk(largest_k, dim=-1).values.gather(1, (top_k.clamp(max=largest_k) - 1)[:, None])
    kth = kth.masked_fill(~filtered[:, None], float("-inf"))
    return logits.masked_fill(logits < kth, float("-inf"))


# How many of the largest logits top-p looks among, widening until they hold top_p of the
# mass: a language model's nucleus is rarely wider than the first; [128, 49,152] float32 on
# two cores, `topk` 256 took 13 ms, 4,096 44 ms, and a whole sort 277 ms.
TOP_P_CANDIDATES = (256, 4096)


def _top_p_filtered(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The smallest set of most likely tokens whose mass reaches top_p kept per row (the most
    likely always), the rest -inf; rows with top_p >= 1 left whole.  On a CPU each row's
    threshold comes from csrc/top_p_rows.c (selection, no sort); elsewhere from `topk` over
    widening candidates."""
    kernel = _top_p_kernel() if logits.device.type == "cpu" else None
    if kernel is not None:
        probs = logits.float().softmax(dim=-1).contiguous()
        top_p = top_p.to(torch.float32).contiguous()
        thresholds = torch.empty(probs.shape[0], dtype=torch.float32)
        failed = kernel(
            probs.data_ptr(), probs.shape[0], probs.shape[1], probs.stride(0), top_p.data_ptr(),
            thresholds.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if not failed:
            return logits.masked_fill(probs < thresholds[:, None], float("-inf"))
    rows = (top_p < 1.0).nonzero().flatten()
    subset, thresholds = logits[rows], top_p[rows]
    vocab = logits.shape[1]
    for candidates in (*(c for c in TOP_P_CANDIDATES if c < vocab), vocab):
        kept = _nucleus(subset, thresholds, candidates)
        if kept is not None:
            break
    out = logits.clone()
    out[rows] = kept
    return out


@functools.cache
def _top_p_kernel() -> Callable[..., int] | None:
    from kvserve.attention.cpu_kernels import kernels_or_none

    kernels = kernels_or_none()
    return None if kernels is None else kernels.top_p_thresholds


def _nucleus(logits: torch.Tensor, top_p: torch.Tensor, candidates: int) -> torch.Tensor | None:
    """`logits` with everything outside each row's nucleus -inf, the nucleus found among the
    `candidates` largest; None when a row's candidates hold less than its top_p."""
    probs = logits.softmax(dim=-1)
    values, order = logits.topk(candidates, dim=-1)
    top_probs = probs.gather(1, order)
    mass = top_probs.cumsum(dim=-1)
    if candidates < logits.shape[1] and bool((mass[:, -1] < top_p).any()):
        return None
    drop = mass - top_probs >= top_p[:, None]  # the mass before a token: the top one stays
    out = torch.full_like(logits, float("-inf"))
    return out.scatter_(1, order, values.masked_fill(drop, float("-inf")))


def _uniforms(
    rows: int,
    device: torch.device,
    generators: list[torch.Generator | None],
    shared: torch.Generator | None,
) -> torch.Tensor:
    """One draw in [0, 1) a row (float64): from the row's own generator where it has one."""
    draws = torch.empty(rows, dtype=torch.float64, device=device).uniform_(generator=shared)
    for row, gen in enumerate(generators):
        if gen is not None:
            draws[row : row + 1].uniform_(generator=gen)
    return draws


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The token whose cumulative-probability interval holds u x (the row's total mass): a
    token of probability 0 has an empty interval and is never drawn.  float64 sums, so that
    49,152 float32 terms add no rounding worth a token's probability."""
    cdf = probs.double().cumsum_(dim=-1)
    total = cdf[:, -1:]
    below_total = torch.nextafter(total, torch.zeros_like(total))  # u x total may round up to it
    targets = torch.minimum(uniforms[:, None] * total, below_total)
    ids = torch.searchsorted(cdf, targets, right=True).flatten()
    return ids.clamp_(max=probs.shape[1] - 1)  # a row of NaNs (a failed forward) finds no interval
