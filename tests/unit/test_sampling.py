"""Sampler: filters keep exactly the right tokens; seeded rows ignore their batch."""

from __future__ import annotations

import math

import pytest
import torch

from kvserve.request import SamplingParams
from kvserve.runner.sampling import SamplingBatch, _filtered_probs, sample

CPU = torch.device("cpu")
LOGITS = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))


def batch(*params: SamplingParams, generators=None) -> SamplingBatch:
    gens = generators or [None] * len(params)
    return SamplingBatch.build(list(params), gens, [], vocab_size=4, device=CPU)


@pytest.mark.parametrize(
    "params, kept",
    [
        (SamplingParams(top_k=2), [0, 1]),
        (SamplingParams(top_p=0.5), [0]),  # the top token alone reaches 0.5
        (SamplingParams(top_p=0.8), [0, 1]),
        (SamplingParams(top_p=0.81), [0, 1, 2]),
        (SamplingParams(min_p=0.5), [0, 1]),  # p >= 0.25
        (SamplingParams(top_k=10), [0, 1, 2, 3]),  # larger than the vocabulary
        (SamplingParams(), [0, 1, 2, 3]),
    ],
)
def test_filters_keep_exactly(params, kept):
    probs = _filtered_probs(LOGITS.clone(), batch(params))[0]
    assert [i for i in range(4) if probs[i] > 0] == kept
    assert math.isclose(probs.sum().item(), 1.0, rel_tol=1e-6)


def test_mixed_top_k_rows_in_one_batch():
    two = _filtered_probs(
        LOGITS.repeat(2, 1), batch(SamplingParams(top_k=1), SamplingParams(top_k=99))
    )
    assert (two[0] > 0).tolist() == [True, False, False, False]
    assert (two[1] > 0).all()


def test_greedy_and_random_rows_together_and_banned_tokens():
    logits = torch.tensor([[0.0, 5.0, 1.0, 0.0], [0.0, 5.0, 1.0, 0.0]])
    b = SamplingBatch.build(
        [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0)],
        [None, None], [(1, [1])], vocab_size=4, device=CPU,
    )  # fmt: skip
    assert sample(logits, b).token_ids.tolist() == [1, 2]  # row 1 may not pick token 1


def test_seeded_row_is_independent_of_its_batch():
    logits = torch.randn(3, 50)
    seeded = SamplingParams(temperature=1.0, seed=5)

    def draw(rows: list[int]) -> int:
        gens = [torch.Generator().manual_seed(5) if r == 0 else None for r in rows]
        params = [seeded if r == 0 else SamplingParams(temperature=1.0) for r in rows]
        b = SamplingBatch.build(params, gens, [], vocab_size=50, device=CPU)
        return sample(logits[rows].clone(), b).token_ids[rows.index(0)].item()

    assert draw([0]) == draw([2, 1, 0]) == draw([1, 0])


def test_sampling_follows_the_distribution():
    logits = LOGITS.repeat(20000, 1)
    b = batch(*[SamplingParams(temperature=1.0)] * 20000)
    counts = torch.bincount(
        sample(logits, b, torch.Generator().manual_seed(0)).token_ids, minlength=4
    )
    freq = (counts / 20000).tolist()
    for got, want in zip(freq, [0.5, 0.3, 0.15, 0.05], strict=True):
        assert abs(got - want) < 0.015
