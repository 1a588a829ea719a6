"""Sampler: [B, vocab] logits -> [B] token ids, with per-request parameters.

Host side (``SamplingBatch.build``) turns per-request parameters into tensors once per step;
device side (``sample``) is vectorized over the batch.  Random rows sample by inverting their
cumulative distribution at one uniform draw each, which is exact for the categorical
distribution and lets each seeded request draw from its own generator: a seeded request's
tokens do not depend on what else shares its batch.  One draw a row, not one a vocabulary
entry: the exponential race (argmax of p / E, E ~ Exp(1)) drew 49,152 values a row, and on a
CPU `exponential_` took 135 ms for 128 rows, more than the decode step it sampled for.  Top-k,
top-p and min-p are floors on the softmax's probabilities, found by selection (on counts for
top-k, on mass for top-p), not by sorting the vocabulary (277 ms at [128, 49,152]), and the
draw applies them as it walks a row: nothing is masked and renormalized first.  On a CPU the
selections and the draw are C passes over each row (native/csrc/sampling/); elsewhere
torch ops.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from kvserve.native import ops
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
    probs, floor = _probs_and_floor(logits / batch.temperature[:, None], batch)
    uniforms = _uniforms(probs.shape[0], probs.device, batch.generators, generator)
    random_ids = _draw(probs, floor, uniforms)
    return SamplerOutput(torch.where(batch.greedy, greedy_ids, random_ids), logprobs)


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], bitmask: np.ndarray) -> None:
    """Set logits[rows[i], t] to -inf where bit t of bitmask[i] is clear (int32 words, bit
    t % 32 of word t // 32: llguidance's packing), in place, for greedy and random rows alike,
    before any temperature or floor.  Tokens past the mask's 32 x width bits (a model
    vocabulary wider than the tokenizer's) are disallowed.  O(len(rows) x vocab): the rows
    without a grammar are not touched.  The bits are unpacked on the host by numpy (~40 us a
    row of 49,152 tokens) into one bool per token; a GPU receives the packed words and
    unpacks them itself."""
    vocab = logits.shape[1]
    on_host = logits.device.type == "cpu" and logits.dtype in _NEG_INF_BITS
    if on_host:
        disallowed = unpack_disallowed_host(bitmask)
    else:
        disallowed = unpack_disallowed_torch(bitmask, logits.device)
    if disallowed.shape[1] >= vocab:
        disallowed = disallowed[:, :vocab]
    else:
        pad = disallowed.new_ones(disallowed.shape[0], vocab - disallowed.shape[1])
        disallowed = torch.cat([disallowed, pad], dim=1)
    if on_host:
        # numpy, one thread, in place on the logits' memory: a torch op this small on a CPU
        # pays for waking its thread team (ms on a busy machine, for 49,152 elements)
        raw = logits if logits.dtype == torch.float32 else logits.view(torch.int16)
        values, fill, flags = raw.numpy(), _NEG_INF_BITS[logits.dtype], disallowed.numpy()
        for i, row in enumerate(rows):
            np.copyto(values[row], fill, where=flags[i])
        return
    for i, row in enumerate(rows):  # in place, row by row: no gather and scatter copies
        logits[row].masked_fill_(disallowed[i], float("-inf"))


# -inf as the logits' own bits: float32 as itself, 16-bit floats as their int16 pattern
_NEG_INF_BITS = {
    torch.float32: np.float32(-np.inf),
    torch.bfloat16: np.int16(-128),  # 0xFF80
    torch.float16: np.int16(-1024),  # 0xFC00
}


def unpack_disallowed_host(bitmask: np.ndarray) -> torch.Tensor:
    """[R, W] int32 words -> [R, 32 x W] bool, True where the bit is clear: the complement's
    bits, unpacked from each word's little-endian bytes."""
    unpacked = np.unpackbits((~bitmask).view(np.uint8), axis=1, bitorder="little")
    return torch.from_numpy(unpacked).view(torch.bool)


def unpack_disallowed_torch(bitmask: np.ndarray, device: torch.device) -> torch.Tensor:
    """The same on `device`, from the packed words (a GPU receives 1/8 of the bytes)."""
    words = torch.from_numpy(bitmask).to(device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    return ((words.unsqueeze(-1) >> shifts) & 1 == 0).flatten(1)


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """Index of each row's maximum (the first on a tie, the first NaN if any, as torch).  On a
    CPU through csrc/sampling/argmax_rows.c (float32 or bfloat16 rows, ~10x faster than torch at
    [128, 49,152]); elsewhere `max(dim).indices`, the same result 3-4x faster than `argmax`
    on a CPU, where argmax is not vectorized."""
    if x.device.type == "cpu" and x.dim() == 2 and x.dtype in _ARGMAX_DTYPES and x.numel():
        kernel = _sample_kernels().argmax
        if kernel is not None and x.stride(1) == 1:
            out = torch.empty(x.shape[0], dtype=torch.int64)
            kernel(x, out)
            return out
    return x.max(dim=-1).indices


_ARGMAX_DTYPES = (torch.float32, torch.bfloat16)


def _filtered_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Softmax after top-k, top-p and min-p filtering (each only when some row uses it)."""
    probs, floor = _probs_and_floor(logits, batch)
    return probs if floor is None else _floored(probs, floor)


def _probs_and_floor(
    logits: torch.Tensor, batch: SamplingBatch
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The softmax, and the per-row floor below which top-k, top-p and min-p drop a
    probability (None: none applies).  All three are floors on the same probabilities, as
    vLLM applies them one after the other, each on what the one before kept renormalized:
    - top-k keeps every token at least as likely as its k-th (softmax is monotonic);
    - top-p's nucleus is every token at least as likely as its last one; over the top-k
      tokens renormalized (mass Z), a nucleus of mass top_p is one of mass top_p x Z among the
      whole row's probabilities, the same tokens;
    - min-p's test after them, p / Z' < max / Z' x min_p, is p < max x min_p."""
    probs = logits.softmax(dim=-1)
    floor, top_p = None, batch.top_p
    if batch.needs_top_k:
        floor, kept_mass = _top_k_floor(probs, batch.top_k)
        top_p = torch.where(top_p < 1.0, top_p * kept_mass, top_p)
    if batch.needs_top_p:
        floor = _highest(floor, _top_p_floor(probs, top_p, within=floor))
    if batch.needs_min_p:
        floor = _highest(floor, probs.amax(dim=-1) * batch.min_p)
    return probs, floor


def _highest(floor: torch.Tensor | None, other: torch.Tensor) -> torch.Tensor:
    return other if floor is None else torch.maximum(floor, other)


def _floored(probs: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    """probs with those below their row's floor set to 0, renormalized."""
    kept = probs.masked_fill(probs < floor[:, None], 0.0)
    return kept / kept.sum(dim=-1, keepdim=True)


def _top_k_floor(probs: torch.Tensor, top_k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's k-th largest probability (a floor: ties with it are kept) and the mass at or
    above it; 0 and 1 for rows whose top_k is the vocabulary size.  On a CPU by selection in C
    (csrc/sampling/sample_rows.c; `topk` and a masking of the logits took ~10 ms at [128, 49,152]);
    elsewhere `topk` to the largest k asked for, not a sort."""
    kernel = _sample_kernels().top_k if probs.device.type == "cpu" else None
    if kernel is not None:
        probs = probs.contiguous()
        top_k = top_k.to(torch.int64).contiguous()
        floor = torch.empty(probs.shape[0], dtype=torch.float32)
        kept = torch.empty(probs.shape[0], dtype=torch.float32)
        if kernel(probs, top_k, floor, kept):
            return floor, kept
    filtered = top_k < probs.shape[1]
    largest_k = int(top_k[filtered].max())
    kth = probs.topk(largest_k, dim=-1).values.gather(1, (top_k.clamp(max=largest_k) - 1)[:, None])
    kth = kth.masked_fill(~filtered[:, None], 0.0)
    kept = probs.masked_fill(probs < kth, 0.0).sum(dim=-1)
    return kth.squeeze(1), torch.where(filtered, kept, torch.ones_like(kept))


# How many of the most likely tokens top-p looks among off the CPU, widening until they hold
# top_p of the mass: a language model's nucleus is rarely wider than the first; [128, 49,152]
# float32 on two cores, `topk` 256 took 13 ms, 4,096 44 ms, and a whole sort 277 ms.
TOP_P_CANDIDATES = (256, 4096)


def _top_p_floor(
    probs: torch.Tensor, top_p: torch.Tensor, within: torch.Tensor | None = None
) -> torch.Tensor:
    """Each row's nucleus threshold: the probability of the least likely token of the
    smallest set of most likely tokens whose mass reaches top_p (0 where top_p >= 1).  On a
    CPU by selection in C (csrc/sampling/sample_rows.c, no sort), among the probabilities at
    or above `within` (the top-k floor, which holds the nucleus) where given; elsewhere by
    `topk` over widening candidates."""
    kernel = _sample_kernels().top_p if probs.device.type == "cpu" else None
    if kernel is not None:
        probs = probs.contiguous()
        top_p = top_p.to(torch.float32).contiguous()
        within = None if within is None else within.to(torch.float32).contiguous()
        floor = torch.empty(probs.shape[0], dtype=torch.float32)
        if kernel(probs, top_p, within, floor):
            return floor
    floor = torch.zeros_like(top_p, dtype=probs.dtype)
    rows = (top_p < 1.0).nonzero().flatten()
    subset, thresholds = probs[rows], top_p[rows]
    vocab = probs.shape[1]
    for candidates in (*(c for c in TOP_P_CANDIDATES if c < vocab), vocab):
        least = _nucleus_floor(subset, thresholds, candidates)
        if least is not None:
            floor[rows] = least
            break
    return floor


class SampleKernels(NamedTuple):
    """The sampler's native entry points (ops.Kernels' sampling part), each None without the
    native library."""

    top_p: Callable[..., bool] | None
    draw: Callable[..., bool] | None
    top_k: Callable[..., bool] | None
    argmax: Callable[..., None] | None


@functools.cache
def _sample_kernels() -> SampleKernels:
    kernels = ops.kernels_or_none()
    if kernels is None:
        return SampleKernels(None, None, None, None)
    return SampleKernels(
        kernels.top_p_thresholds, kernels.draw_rows, kernels.top_k_floors, kernels.argmax_rows
    )


def _nucleus_floor(
    probs: torch.Tensor, top_p: torch.Tensor, candidates: int
) -> torch.Tensor | None:
    """Each row's nucleus threshold found among its `candidates` most likely tokens; None when
    a row's candidates hold less than its top_p."""
    top_probs = probs.topk(candidates, dim=-1).values
    mass = top_probs.cumsum(dim=-1)
    if candidates < probs.shape[1] and bool((mass[:, -1] < top_p).any()):
        return None
    dropped = mass - top_probs >= top_p[:, None]  # the mass before a token: the top one stays
    return top_probs.masked_fill(dropped, float("inf")).amin(dim=-1)


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


def _draw(probs: torch.Tensor, floor: torch.Tensor | None, uniforms: torch.Tensor) -> torch.Tensor:
    """Each row's token at its uniform draw (`_inverse_cdf`), probabilities below the row's
    floor counting as 0: on a CPU one pass over the row in C (csrc/sampling/sample_rows.c)."""
    kernel = _sample_kernels().draw if probs.device.type == "cpu" else None
    if kernel is not None and probs.dtype == torch.float32:
        probs = probs.contiguous()
        floor = None if floor is None else floor.to(torch.float32).contiguous()
        ids = torch.empty(probs.shape[0], dtype=torch.int64)
        if kernel(probs, floor, uniforms.contiguous(), ids):
            return ids
    return _inverse_cdf(probs if floor is None else _floored(probs, floor), uniforms)


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
