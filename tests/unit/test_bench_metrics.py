"""The statistics of `kvserve bench serve` on synthetic timestamps, compared exactly.

Times are multiples of 1/8 s (exact in binary), so every expected number below is
computed by hand and compared with ==.
"""

from __future__ import annotations

import math
import statistics

import pytest

from kvserve.bench.metrics import (
    RequestRecord,
    completions_per_second,
    compute_metrics,
    distribution,
    meets_slos,
    percentile,
    throughput_bin_s,
)
from kvserve.bench.runner import arrival_offsets


def rec(ttft: float, itl: list[float], output_len: int, input_len: int = 10) -> RequestRecord:
    """A completed request whose latency is TTFT + its gaps."""
    return RequestRecord(
        prompt_len=input_len,
        expected_output_len=output_len,
        success=True,
        input_len=input_len,
        output_len=output_len,
        ttft=ttft,
        itl=itl,
        latency=ttft + sum(itl),
    )


def test_percentile_interpolates_between_closest_ranks() -> None:
    values = [4.0, 1.0, 3.0, 2.0]  # sorted: 1 2 3 4, rank = p/100 x 3
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == 2.5
    assert percentile(values, 100) == 4.0
    assert percentile(values, 25) == 1.75
    assert percentile([5.0], 99) == 5.0
    assert percentile([], 50) == 0.0
    assert percentile([0.0, 8.0], 12.5) == 1.0


def test_percentile_matches_numpy_linear() -> None:
    np = pytest.importorskip("numpy")
    values = [0.3, 1.7, 0.2, 9.1, 4.4, 4.4, 2.0]
    for p in (1, 10, 33.3, 50, 90, 99, 99.9):
        assert percentile(values, p) == pytest.approx(float(np.percentile(values, p)), abs=1e-12)


def test_distribution_in_ms() -> None:
    d = distribution([0.125, 0.25, 0.5, 0.125], [50, 75])
    assert d.mean == 250.0  # (125 + 250 + 500 + 125) / 4
    assert d.median == 187.5
    assert d.std == math.sqrt(((125 - 250) ** 2 * 2 + 0 + 250**2) / 4)
    assert d.std == statistics.pstdev([125, 250, 500, 125])
    assert d.percentiles == {50: 187.5, 75: 312.5}  # rank 2.25: 250 + 0.25 x 250
    assert d.as_dict("ttft") == {
        "mean_ttft_ms": 250.0,
        "median_ttft_ms": 187.5,
        "std_ttft_ms": d.std,
        "p50_ttft_ms": 187.5,
        "p75_ttft_ms": 312.5,
    }
    empty = distribution([], [99])
    assert (empty.mean, empty.median, empty.std, empty.percentiles) == (0.0, 0.0, 0.0, {99: 0.0})


def test_tpot_excludes_the_first_token() -> None:
    r = rec(0.5, [0.125, 0.25, 0.125], 4)  # latency 1.0
    assert r.tpot == (1.0 - 0.5) / 3
    # several tokens in one chunk: TPOT counts tokens, ITL counts chunks
    assert rec(0.5, [0.5], 3).tpot == 0.25
    assert rec(0.5, [], 1).tpot is None


def test_compute_metrics_from_synthetic_records() -> None:
    records = [
        rec(0.125, [0.25, 0.25], 3, input_len=100),  # latency 0.625, TPOT 0.25
        rec(0.5, [0.125], 2, input_len=50),  # latency 0.625, TPOT 0.125
        rec(0.25, [], 1, input_len=30),  # latency 0.25, no TPOT
        RequestRecord(prompt_len=70, expected_output_len=8, input_len=70, error="HTTP 500"),
    ]
    m = compute_metrics(
        records, duration=2.0, percentiles=[50, 100], slos_ms={"ttft": 250, "tpot": 200}
    )
    assert (m.completed, m.failed) == (3, 1)
    assert (m.total_input, m.total_output) == (180, 6)  # the failed request is not counted
    assert m.request_throughput == 1.5
    assert m.output_throughput == 3.0
    assert m.total_token_throughput == 93.0
    # SLOs: #1 TPOT 250 > 200 fails, #2 TTFT 500 > 250 fails, #3 TTFT 250 <= 250 meets
    assert m.goodput == 0.5
    ttft, tpot, itl, e2el = (m.distributions[n] for n in ("ttft", "tpot", "itl", "e2el"))
    assert ttft.mean == (125 + 500 + 250) / 3 and ttft.median == 250.0
    assert tpot.mean == 187.5 and tpot.percentiles == {50: 187.5, 100: 250.0}
    assert itl.mean == (250 + 250 + 125) / 3 and itl.percentiles[100] == 250.0
    assert e2el.mean == 500.0 and e2el.median == 625.0 and e2el.percentiles[50] == 625.0


def test_goodput_is_none_without_slos_and_rejects_bad_duration() -> None:
    assert compute_metrics([rec(0.125, [], 1)], 1.0).goodput is None
    with pytest.raises(ValueError, match="duration"):
        compute_metrics([], 0.0)


def test_meets_slos_compares_in_ms() -> None:
    r = rec(0.5, [0.125], 2)  # TTFT 500 ms, TPOT 125 ms, E2EL 625 ms
    assert meets_slos(r, {"ttft": 500, "tpot": 125, "e2el": 625})
    assert not meets_slos(r, {"e2el": 624.9})
    assert meets_slos(rec(0.125, [], 1), {"tpot": 1})  # one token: TPOT counts as 0


def test_completions_per_second_bins() -> None:
    bins = completions_per_second([0.1, 0.2, 1.5, 2.9, 3.0], duration=3.0, bin_s=1.0)
    assert bins == [(0.0, 2.0), (1.0, 1.0), (2.0, 2.0)]  # t = duration lands in the last bin
    assert completions_per_second([0.25], 0.5, bin_s=0.5) == [(0.0, 2.0)]
    assert (throughput_bin_s(20.0), throughput_bin_s(350.0)) == (1.0, 6.0)


def test_arrival_offsets() -> None:
    assert arrival_offsets(3, math.inf, 1.0, seed=0) == [0.0, 0.0, 0.0]
    poisson = arrival_offsets(4000, 10.0, 1.0, seed=1)
    assert poisson[0] == 0.0 and poisson == sorted(poisson)
    assert poisson == arrival_offsets(4000, 10.0, 1.0, seed=1)  # seeded
    gaps = [b - a for a, b in zip(poisson, poisson[1:], strict=False)]
    assert statistics.mean(gaps) == pytest.approx(0.1, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(0.1, rel=0.08)  # exponential: std = mean
    regular = arrival_offsets(4000, 10.0, 100.0, seed=1)
    regular_gaps = [b - a for a, b in zip(regular, regular[1:], strict=False)]
    assert statistics.mean(regular_gaps) == pytest.approx(0.1, rel=0.05)
    assert statistics.stdev(regular_gaps) == pytest.approx(0.01, rel=0.1)  # mean / sqrt(shape)
