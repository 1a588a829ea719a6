"""Sampler: filters keep exactly the right tokens; seeded rows ignore their batch."""

from __future__ import annotations

import math

import pytest
import torch

from kvserve.request import SamplingParams
from kvserve.runner import sampling
from kvserve.runner.sampling import (
    SamplingBatch,
    _argmax,
    _filtered_probs,
    _inverse_cdf,
    sample,
)

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols", [1, 7, 16, 49, 1000, 49152])
def test_argmax_is_torch_s_index_on_ties_nans_and_strided_rows(dtype, cols):
    """The C argmax against torch's max(dim).indices: random rows, rows of ties (bf16 rounds
    many neighbours to one value), a NaN row, and rows that are a strided slice."""
    assert sampling._sample_kernels().argmax is not None  # the C path is the one under test
    gen = torch.Generator().manual_seed(cols)
    wide = torch.randn(9, cols + 5, generator=gen).to(dtype)
    wide[1] = 3.0  # every column ties: index 0
    wide[2, cols // 2 :] = 1e4  # a tie from the middle: the first of them
    wide[3, cols - 1] = float("nan")  # torch picks the NaN
    wide[4, : cols // 3] = float("-inf")
    logits = wide[:, :cols]  # row stride cols + 5
    expected = logits.float().max(dim=-1).indices
    assert _argmax(logits).tolist() == expected.tolist()
    assert _argmax(logits[:1]).tolist() == expected[:1].tolist()  # one row: no thread team


def test_greedy_rows_take_the_argmax_of_bf16_logits_as_float32_would():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 4000, generator=gen).to(torch.bfloat16)
    greedy = SamplingBatch.build(
        [SamplingParams(temperature=0.0)] * 64, [None] * 64, [], vocab_size=4000, device=CPU
    )
    assert sample(logits, greedy).token_ids.tolist() == logits.float().argmax(-1).tolist()
    with_logprobs = SamplingBatch.build(
        [SamplingParams(temperature=0.0, logprobs=2)] * 64, [None] * 64, [], 4000, CPU
    )
    out = sample(logits, with_logprobs)
    assert out.token_ids.tolist() == logits.float().argmax(-1).tolist()
    assert out.logprobs is not None and out.logprobs.dtype == torch.float32


def no_kernels() -> sampling.SampleKernels:
    """_sample_kernels where the C library is missing (a GPU, or no compiler)."""
    return sampling.SampleKernels(None, None, None, None)


def sorted_reference(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Top-k then top-p by sorting each whole row (the filters' definitions), as probabilities."""
    out = []
    for row, k, p in zip(logits, top_k, top_p, strict=True):
        values, order = row.sort(descending=True)
        values = values.masked_fill(values < values[k - 1], float("-inf"))
        if p < 1.0:
            probs = values.softmax(dim=-1)
            values = values.masked_fill(probs.cumsum(dim=-1) - probs >= p, float("-inf"))
        out.append(torch.empty_like(row).scatter_(0, order, values).softmax(dim=-1))
    return torch.stack(out)


@pytest.mark.parametrize("candidates", ["kernel", (256, 4096), (3,), ()])
def test_top_k_and_top_p_keep_what_sorting_whole_rows_keeps(monkeypatch, candidates):
    """On a CPU, top-p's threshold comes from csrc/sampling/sample_rows.c (selection on mass, no
    sort); elsewhere the filters look among the largest logits (`topk`), widening the candidates
    until they hold top_p of the mass: with candidates too few for some rows (3), or none (a
    whole sort).  Either way the kept tokens are the ones a sort of each whole row keeps."""
    if candidates == "kernel":
        if sampling._sample_kernels().top_p is None:
            pytest.skip("no C kernels here")
    else:
        monkeypatch.setattr(sampling, "_sample_kernels", no_kernels)
        monkeypatch.setattr(sampling, "TOP_P_CANDIDATES", candidates)
    gen = torch.Generator().manual_seed(3)
    scales = torch.tensor([0.5, 2, 4, 8, 1, 3, 6, 0.1])[:, None]
    logits = torch.randn(8, 5000, generator=gen) * scales
    top_k = [5000, 40, 5000, 7, 5000, 300, 5000, 5000]
    top_p = [0.9, 1.0, 0.5, 0.95, 1.0, 0.99, 0.01, 0.999]
    params = [SamplingParams(temperature=1.0, top_k=k if k < 5000 else 0, top_p=p)
              for k, p in zip(top_k, top_p, strict=True)]  # fmt: skip
    b = SamplingBatch.build(params, [None] * 8, [], vocab_size=5000, device=CPU)
    got = _filtered_probs(logits.clone(), b)
    want = sorted_reference(logits, top_k, top_p)
    assert torch.equal(got > 0, want > 0)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_draws_never_fall_on_filtered_tokens_even_at_the_top_of_the_unit_interval():
    """u x the row's mass lands in one token's interval of the cumulative sums; a token of
    probability 0 (filtered, or the tail past the last kept one) has none, even for u just
    below 1, where u x mass may round up to the mass itself."""
    probs = torch.tensor([[0.0, 0.6, 0.4, 0.0, 0.0], [0.25, 0.0, 0.0, 0.75, 0.0]])
    below_one = torch.nextafter(
        torch.tensor(1.0, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64)
    )
    cases = [
        (0.0, [1, 0]),
        (0.24, [1, 0]),
        (0.59, [1, 3]),
        (0.61, [2, 3]),
        (float(below_one), [2, 3]),
    ]
    for u, want in cases:
        assert _inverse_cdf(probs, torch.tensor([u, u], dtype=torch.float64)).tolist() == want


def test_the_c_draw_equals_the_torch_draw_with_floors_applied():
    """csrc/sampling/sample_rows.c's draw (probabilities below the row's floor counted as 0,
    walked in chunks of 16) picks the token torch's float64 cumulative sums pick for the same
    uniform, and never one below its row's floor."""
    draw_kernel = sampling._sample_kernels().draw
    if draw_kernel is None:
        pytest.skip("no C kernels here")
    gen = torch.Generator().manual_seed(11)
    rows, vocab = 64, 1037  # a vocabulary that is not a multiple of 16
    probs = (torch.randn(rows, vocab, generator=gen) * 2).softmax(dim=-1)
    floor = torch.rand(rows, generator=gen) * probs.amax(dim=-1) * 0.5
    floor[::4] = 0.0  # rows without a floor
    uniforms = torch.rand(rows, dtype=torch.float64, generator=gen)
    uniforms[0], uniforms[1] = (
        0.0,
        float(
            torch.nextafter(
                torch.tensor(1.0, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64)
            )
        ),
    )
    got = sampling._draw(probs, floor, uniforms)
    want = _inverse_cdf(sampling._floored(probs, floor), uniforms)
    assert torch.equal(got, want)
    assert (probs[torch.arange(rows), got] >= floor).all()
    assert torch.equal(sampling._draw(probs, None, uniforms), _inverse_cdf(probs, uniforms))


@pytest.mark.parametrize("cols", [1, 5, 17, 1000, 49152])
def test_the_c_top_k_floor_is_the_k_th_largest_probability_ties_kept(cols):
    """csrc/sampling/sample_rows.c's top-k selection (quickselect on counts) against a sort of each
    row: the floor is the k-th largest probability, and the kept mass is that of every token
    at or above it, ties with the k-th included (bf16 logits tie often); rows with top_k at
    or past the vocabulary keep everything (floor 0, mass 1), and a NaN row stays whole."""
    kernel = sampling._sample_kernels().top_k
    if kernel is None:
        pytest.skip("no C kernels here")
    gen = torch.Generator().manual_seed(cols)
    rows = 12
    logits = (torch.randn(rows, cols, generator=gen) * 3).bfloat16().float()
    logits[1] = 0.5  # every token ties
    probs = logits.softmax(dim=-1)
    probs[2] = float("nan")
    ks = [1, cols, cols + 7, max(cols - 1, 1), 2, 40, 1, 3, 50, 1000, 7, cols // 2 + 1]
    top_k = torch.tensor(ks)
    floor, kept = sampling._top_k_floor(probs, top_k)
    for r in range(rows):
        k = int(top_k[r])
        if r == 2 or k >= cols:
            assert (floor[r].item(), kept[r].item()) == (0.0, 1.0)
            continue
        kth = probs[r].sort(descending=True).values[k - 1]
        assert floor[r].item() == kth.item()
        want = probs[r][probs[r] >= kth].double().sum().item()
        assert math.isclose(kept[r].item(), want, rel_tol=1e-6)
    ties = probs[1] >= floor[1]
    assert bool(ties.all()) or cols == 1  # the all-ties row keeps every token


def test_top_k_on_the_cpu_and_in_torch_give_the_same_floors(monkeypatch):
    """The C selection and the torch path (`topk`, for devices without the kernels) agree
    on every row of a realistic batch, ties and all."""
    if sampling._sample_kernels().top_k is None:
        pytest.skip("no C kernels here")
    gen = torch.Generator().manual_seed(5)
    probs = ((torch.randn(32, 4096, generator=gen) * 4).bfloat16().float()).softmax(dim=-1)
    top_k = torch.randint(1, 5000, (32,), generator=gen)
    floor, kept = sampling._top_k_floor(probs, top_k)
    monkeypatch.setattr(sampling, "_sample_kernels", no_kernels)
    torch_floor, torch_kept = sampling._top_k_floor(probs, top_k)
    assert torch.equal(floor, torch_floor)
    torch.testing.assert_close(kept, torch_kept, rtol=1e-6, atol=0)


def test_top_p_within_the_top_k_floor_finds_the_whole_row_s_threshold():
    """With the top-k floor given, the C top-p selection looks only at the tokens at or above
    it (one pass instead of a copy of the row): the nucleus of mass top_p x (their mass) is
    the same as over the whole row, ties with the floor included."""
    kernels = sampling._sample_kernels()
    if kernels.top_p is None:
        pytest.skip("no C kernels here")
    gen = torch.Generator().manual_seed(9)
    logits = (torch.randn(16, 3000, generator=gen) * 3).bfloat16().float()
    logits[4, :100] = logits[4].max()  # a hundred tokens tied at the top
    probs = logits.softmax(dim=-1)
    top_k = torch.tensor([1, 2, 7, 40, 50, 100, 300, 2999, 5, 40, 3000, 9, 60, 200, 1000, 13])
    top_p = torch.tensor([0.9, 0.5, 0.95, 0.8, 0.3, 0.99, 0.6, 0.9, 1.0, 0.0001, 0.9, 0.97,
                          0.5, 0.85, 0.75, 0.999])  # fmt: skip
    floor, kept = sampling._top_k_floor(probs, top_k)
    target = torch.where(top_p < 1.0, top_p * kept, top_p)
    within = sampling._top_p_floor(probs, target, within=floor)
    whole = sampling._top_p_floor(probs, target)
    assert torch.equal(within, whole)
    assert (within >= floor)[top_p < 1.0].all()  # the nucleus lies within the top k
