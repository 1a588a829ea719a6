"""Greedy generation through a paged KV cache, and agreement between two dtypes' tokens.

Agreement is measured free-running, as a user would see it: each dtype generates its own
continuation (no teacher forcing), and the two token lists are compared position by
position to the end.  After a first divergence the contexts differ, so later positions
count as whatever they happen to be; `identical_prefix_tokens` separately counts the
tokens before each prompt's first divergence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.evaluation.paged import PagedCache, Piece, contiguous_tables, forward_hidden
from kvserve.kv.spec import cdiv


def cache_blocks_needed(num_prompts: int, max_prompt_len: int, max_tokens: int, block_size: int):
    """Blocks a PagedCache must hold for `greedy_generate` with these sizes."""
    return num_prompts * cdiv(max_prompt_len + max_tokens, block_size)


def greedy_generate(
    model: torch.nn.Module,
    cache: PagedCache,
    prompts: list[list[int]],
    max_tokens: int,
    chunk_size: int,
    device: torch.device,
) -> list[list[int]]:
    """Argmax continuation of `max_tokens` tokens per prompt (never stopping at EOS).

    Prompts are prefilled side by side in chunks of `chunk_size`, then decoded together one
    token per step, each through its own blocks of `cache` (overwritten)."""
    if max_tokens <= 0:
        return [[] for _ in prompts]
    block_size = cache.spec.block_size
    total = max(len(p) for p in prompts) + max_tokens
    tables = contiguous_tables(len(prompts), total, block_size)
    if len(tables) * len(tables[0]) > cache.num_blocks:
        raise ValueError(f"the cache holds {cache.num_blocks} blocks; generation needs more")
    last_hidden = _prefill(model, cache, prompts, tables, chunk_size, device)
    outputs: list[list[int]] = [[] for _ in prompts]
    for step in range(max_tokens):
        with torch.inference_mode():
            next_ids = model.compute_logits(last_hidden).argmax(dim=-1).tolist()
        for out, token_id in zip(outputs, next_ids, strict=True):
            out.append(token_id)
        if step == max_tokens - 1:
            break
        pieces = [
            Piece(str(i), [out[-1]], len(prompt) + step, tables[i])
            for i, (prompt, out) in enumerate(zip(prompts, outputs, strict=True))
        ]
        last_hidden = torch.cat(forward_hidden(model, cache, pieces, device))
    return outputs


def _prefill(
    model: torch.nn.Module,
    cache: PagedCache,
    prompts: list[list[int]],
    tables: list[list[int]],
    chunk_size: int,
    device: torch.device,
) -> torch.Tensor:
    """Prefill all prompts in chunks; the hidden state of each prompt's last token [N, H]."""
    last: dict[int, torch.Tensor] = {}
    for start in range(0, max(len(p) for p in prompts), chunk_size):
        live = [i for i, p in enumerate(prompts) if start < len(p)]
        pieces = [
            Piece(str(i), prompts[i][start : start + chunk_size], start, tables[i]) for i in live
        ]
        for i, h in zip(live, forward_hidden(model, cache, pieces, device), strict=True):
            last[i] = h[-1]
    return torch.stack([last[i] for i in range(len(prompts))])


@dataclass(frozen=True)
class Agreement:
    num_prompts: int
    num_tokens: int  # positions compared, over all prompts
    num_identical: int  # positions where both dtypes produced the same token
    identical_prefix_tokens: int  # tokens before each prompt's first divergence, summed
    num_prompts_identical: int  # prompts whose whole continuation is identical

    @property
    def share(self) -> float:
        return self.num_identical / self.num_tokens if self.num_tokens else 1.0

    @property
    def mean_identical_prefix(self) -> float:
        return self.identical_prefix_tokens / self.num_prompts if self.num_prompts else 0.0


def greedy_agreement(reference: list[list[int]], candidate: list[list[int]]) -> Agreement:
    """Compare two runs' continuations prompt by prompt, position by position."""
    if len(reference) != len(candidate):
        raise ValueError("reference and candidate must have one continuation per prompt each")
    num_tokens = num_identical = prefix_total = whole = 0
    for ref, cand in zip(reference, candidate, strict=True):
        same = [a == b for a, b in zip(ref, cand, strict=True)]
        num_tokens += len(same)
        num_identical += sum(same)
        prefix = same.index(False) if False in same else len(same)
        prefix_total += prefix
        whole += prefix == len(same)
    return Agreement(len(reference), num_tokens, num_identical, prefix_total, whole)
