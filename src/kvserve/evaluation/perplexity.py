"""Perplexity of a text through the paged KV cache of one dtype.

The text's tokens are cut into consecutive windows of `context_len` tokens; each window is
prefilled in chunks of `chunk_size`, so every chunk after the first attends over K/V that
went through the cache (quantized and dequantized for an 8-bit dtype):

    window:  [ chunk 0 | chunk 1 | chunk 2 | ... ]
               fresh     reads the cache for chunks 0..1 (and its own K/V, also via the cache)

The first chunk of a window attends over its own fresh K/V (the reference backend's
first-chunk path), which is why small chunks measure the cache best.  Every token of a window
but the last is scored on predicting the next one; perplexity = exp(total NLL / count).
Several windows share each step (as separate sequences) so the weights are read once per
~256 tokens rather than once per chunk.

`compare` runs several caches (one per KV dtype) in lockstep, chunk by chunk, so that each
position's next-token distribution under every dtype can be compared with the first one's
(the KL divergence) without keeping the reference's distributions for the whole text.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.errors import UserInputError
from kvserve.evaluation.paged import PagedCache, Piece, contiguous_tables, forward_hidden
from kvserve.kv.spec import cdiv

TOKENS_PER_STEP = 256


@dataclass(frozen=True)
class PerplexityResult:
    nll_sum: float  # natural-log negative log-likelihood over all predicted tokens
    num_predicted: int
    kl_sum: float = 0.0  # sum over positions of KL(reference || this), nats (`compare`)

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll_sum / self.num_predicted)

    @property
    def mean_kl(self) -> float:
        """Mean KL divergence of the next-token distributions from the reference's."""
        return self.kl_sum / self.num_predicted


def split_windows(token_ids: list[int], context_len: int) -> list[list[int]]:
    """Consecutive, non-overlapping windows; a last window of one token predicts nothing."""
    windows = [token_ids[i : i + context_len] for i in range(0, len(token_ids), context_len)]
    return [w for w in windows if len(w) >= 2]


def windows_per_step(context_len: int, chunk_size: int) -> int:
    return max(1, TOKENS_PER_STEP // min(chunk_size, context_len))


def cache_blocks_needed(context_len: int, chunk_size: int, block_size: int) -> int:
    """Blocks a PagedCache must hold for `perplexity` with these settings."""
    return windows_per_step(context_len, chunk_size) * cdiv(context_len, block_size)


def perplexity(
    model: torch.nn.Module,
    cache: PagedCache,
    token_ids: list[int],
    context_len: int,
    chunk_size: int,
    device: torch.device,
) -> PerplexityResult:
    """NLL of `token_ids` through `cache` (overwritten; needs cache_blocks_needed blocks)."""
    [result] = compare(model, [cache], token_ids, context_len, chunk_size, device)
    return result


def compare(
    model: torch.nn.Module,
    caches: list[PagedCache],
    token_ids: list[int],
    context_len: int,
    chunk_size: int,
    device: torch.device,
) -> list[PerplexityResult]:
    """NLL of `token_ids` through each cache, and each one's KL divergence from the first
    one's next-token distributions, position by position (the caches are overwritten; each
    needs cache_blocks_needed blocks)."""
    windows = split_windows(token_ids, context_len)
    if not windows:
        raise UserInputError("the text has fewer than 2 tokens to evaluate")
    group_size = windows_per_step(context_len, chunk_size)
    tables = contiguous_tables(group_size, context_len, caches[0].spec.block_size)
    if any(len(tables) * len(tables[0]) > cache.num_blocks for cache in caches):
        raise ValueError("a cache holds too few blocks for this perplexity run")
    totals = [[0.0, 0.0] for _ in caches]  # NLL, KL
    count = 0
    for first in range(0, len(windows), group_size):
        group = windows[first : first + group_size]
        for start in range(0, max(len(w) for w in group), chunk_size):
            sums, predicted = _chunk_sums(model, caches, group, tables, start, chunk_size, device)
            for total, (nll, kl) in zip(totals, sums, strict=True):
                total[0] += nll
                total[1] += kl
            count += predicted
    return [PerplexityResult(nll, count, kl) for nll, kl in totals]


def _chunk_sums(
    model: torch.nn.Module,
    caches: list[PagedCache],
    windows: list[list[int]],
    tables: list[list[int]],
    start: int,
    chunk_size: int,
    device: torch.device,
) -> tuple[list[tuple[float, float]], int]:
    """One chunk of windows side by side through each cache: per cache (NLL sum, KL sum from
    the first cache), and the number of tokens predicted."""
    live = [i for i, w in enumerate(windows) if start < len(w)]
    pieces = [Piece(str(i), windows[i][start : start + chunk_size], start, tables[i]) for i in live]
    # Position p predicts token p + 1; the window's last token predicts nothing.
    targets = [windows[i][start + 1 : start + 1 + chunk_size] for i in live]
    flat_targets = [t for target in targets for t in target]
    sums, reference = [], None
    for cache in caches:
        hidden = forward_hidden(model, cache, pieces, device)
        if not flat_targets:
            sums.append((0.0, 0.0))
            continue
        rows = [h[: len(target)] for h, target in zip(hidden, targets, strict=True)]
        with torch.inference_mode():
            logprobs = F.log_softmax(model.compute_logits(torch.cat(rows)), dim=-1)
            target_ids = torch.tensor(flat_targets, device=logprobs.device)
            nll = F.nll_loss(logprobs, target_ids, reduction="sum")
            if reference is None:
                reference = logprobs
            kl = F.kl_div(logprobs, reference, log_target=True, reduction="sum")
        sums.append((float(nll), float(kl)))
    return sums, len(flat_targets)
