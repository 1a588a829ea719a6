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

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll_sum / self.num_predicted)


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
    windows = split_windows(token_ids, context_len)
    if not windows:
        raise UserInputError("the text has fewer than 2 tokens to evaluate")
    group_size = windows_per_step(context_len, chunk_size)
    block_size = cache.spec.block_size
    tables = contiguous_tables(group_size, context_len, block_size)
    if len(tables) * len(tables[0]) > cache.num_blocks:
        raise ValueError(f"the cache holds {cache.num_blocks} blocks; perplexity needs more")
    nll_sum, count = 0.0, 0
    run = _PagedRun(model, cache, chunk_size, device)
    for first in range(0, len(windows), group_size):
        group_nll, group_count = _group_nll(run, windows[first : first + group_size], tables)
        nll_sum += group_nll
        count += group_count
    return PerplexityResult(nll_sum, count)


@dataclass(frozen=True)
class _PagedRun:
    """What every group of windows runs through."""

    model: torch.nn.Module
    cache: PagedCache
    chunk_size: int
    device: torch.device


def _group_nll(
    run: _PagedRun, windows: list[list[int]], tables: list[list[int]]
) -> tuple[float, int]:
    """Prefill windows side by side, chunk by chunk; sum the NLL of each next token."""
    model, cache, chunk_size, device = run.model, run.cache, run.chunk_size, run.device
    nll_sum, count = 0.0, 0
    for start in range(0, max(len(w) for w in windows), chunk_size):
        live = [i for i, w in enumerate(windows) if start < len(w)]
        pieces = [
            Piece(str(i), windows[i][start : start + chunk_size], start, tables[i]) for i in live
        ]
        hidden = forward_hidden(model, cache, pieces, device)
        rows, targets = [], []
        for i, piece, h in zip(live, pieces, hidden, strict=True):
            # Position p predicts token p + 1; the window's last token predicts nothing.
            target = windows[i][start + 1 : start + 1 + len(piece.token_ids)]
            rows.append(h[: len(target)])
            targets.extend(target)
        if not targets:
            continue
        with torch.inference_mode():
            logits = model.compute_logits(torch.cat(rows))
            target_ids = torch.tensor(targets, device=logits.device)
            nll = F.cross_entropy(logits, target_ids, reduction="sum")
        nll_sum += float(nll)
        count += len(targets)
    return nll_sum, count
