"""Pure statistics of a serving benchmark: per-request records in, summary numbers out.

No clock, no network: every number here is a function of the records and the run's
duration, so tests can feed synthetic timestamps and compare with exact equality.

Definitions (the same as vLLM's serving benchmark):

    TTFT  = first content chunk - request sent
    ITL   = gap between consecutive content chunks (a chunk may carry several tokens)
    TPOT  = (latency - TTFT) / (output_len - 1), only for requests with output_len > 1
    E2EL  = latency = end of the response stream - request sent
    throughput = totals of *completed* requests / benchmark duration
    goodput    = completed requests meeting every SLO / duration
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvserve.bench.config import METRIC_NAMES


@dataclass
class RequestRecord:
    """What one request did.  Times are seconds; start/end are offsets from the run's start."""

    prompt_len: int  # what the dataset asked for
    expected_output_len: int  # max_tokens sent
    success: bool = False
    input_len: int = 0  # prompt tokens as the server counted them (usage), else prompt_len
    output_len: int = 0  # completion tokens (usage), else counted by the client
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0
    end_time: float = 0.0
    generated_text: str = ""
    error: str = ""
    cached_tokens: int = 0  # prompt tokens the server found cached (usage), if it says
    turn: int | None = None  # a chat turn's index in its conversation (multi-turn), from 0

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None when there is no second token."""
        if self.output_len <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)


@dataclass(frozen=True)
class Distribution:
    """Summary of one latency metric, in milliseconds."""

    mean: float
    median: float
    std: float
    percentiles: dict[float, float]  # p -> value

    def as_dict(self, name: str) -> dict[str, float]:
        row = {
            f"mean_{name}_ms": self.mean,
            f"median_{name}_ms": self.median,
            f"std_{name}_ms": self.std,
        }
        for p, value in self.percentiles.items():
            row[f"p{_pct_label(p)}_{name}_ms"] = value
        return row


@dataclass(frozen=True)
class BenchmarkMetrics:
    """Everything the report prints, computed from the records."""

    completed: int
    failed: int
    duration: float
    total_input: int
    total_output: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    goodput: float | None  # requests/s meeting all SLOs; None without SLOs
    distributions: dict[str, Distribution]  # metric name -> summary (ms)


def percentile(values: Sequence[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default "linear" method):
    rank = p/100 x (n - 1).  Written out so tests do not depend on numpy's rounding."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = p / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution(values_s: Sequence[float], percentiles: Sequence[float]) -> Distribution:
    """Mean, median, population std and percentiles of seconds, reported in ms (0 if empty)."""
    ms = [v * 1000 for v in values_s]
    if not ms:
        return Distribution(0.0, 0.0, 0.0, {p: 0.0 for p in percentiles})
    mean = sum(ms) / len(ms)
    std = math.sqrt(sum((v - mean) ** 2 for v in ms) / len(ms))
    return Distribution(
        mean=mean,
        median=percentile(ms, 50),
        std=std,
        percentiles={p: percentile(ms, p) for p in percentiles},
    )


def metric_values(records: Sequence[RequestRecord], name: str) -> list[float]:
    """Seconds for one metric over the completed requests (ITL: every gap of every request)."""
    done = [r for r in records if r.success]
    if name == "ttft":
        return [r.ttft for r in done]
    if name == "tpot":
        return [t for r in done if (t := r.tpot) is not None]
    if name == "itl":
        return [gap for r in done for gap in r.itl]
    if name == "e2el":
        return [r.latency for r in done]
    raise ValueError(f"unknown metric {name!r}; choose from {', '.join(METRIC_NAMES)}")


def meets_slos(record: RequestRecord, slos_ms: dict[str, float]) -> bool:
    """A request with one output token has TPOT 0 here, so only its TTFT/E2EL can fail."""
    seconds = {"ttft": record.ttft, "tpot": record.tpot or 0.0, "e2el": record.latency}
    return all(seconds[name] * 1000 <= limit for name, limit in slos_ms.items())


def compute_metrics(
    records: Sequence[RequestRecord],
    duration: float,
    percentiles: Sequence[float] = (99.0,),
    slos_ms: dict[str, float] | None = None,
) -> BenchmarkMetrics:
    """The summary of a run.  `duration` is wall time from the first send to the last end."""
    if duration <= 0:
        raise ValueError(f"duration must be positive, got {duration}")
    done = [r for r in records if r.success]
    total_input = sum(r.input_len for r in done)
    total_output = sum(r.output_len for r in done)
    goodput = None
    if slos_ms:
        goodput = sum(meets_slos(r, slos_ms) for r in done) / duration
    return BenchmarkMetrics(
        completed=len(done),
        failed=len(records) - len(done),
        duration=duration,
        total_input=total_input,
        total_output=total_output,
        request_throughput=len(done) / duration,
        output_throughput=total_output / duration,
        total_token_throughput=(total_input + total_output) / duration,
        goodput=goodput,
        distributions={
            n: distribution(metric_values(records, n), percentiles) for n in METRIC_NAMES
        },
    )


def completions_per_second(
    end_times: Sequence[float], duration: float, bin_s: float = 1.0
) -> list[tuple[float, float]]:
    """(bin start, completed requests per second in the bin) over [0, duration]: the request
    throughput over time, drawn under the memory timeline."""
    num_bins = max(1, math.ceil(duration / bin_s))
    counts = [0] * num_bins
    for t in end_times:
        counts[min(num_bins - 1, max(0, int(t // bin_s)))] += 1
    return [(i * bin_s, c / bin_s) for i, c in enumerate(counts)]


def throughput_bin_s(duration: float) -> float:
    """1 s bins, wider for long runs (about 60 bars), so the rate reads as a rate, not spikes."""
    return max(1.0, float(round(duration / 60)))


def _pct_label(p: float) -> str:
    """99.0 -> "99", 99.9 -> "99.9" (vLLM's key names)."""
    return str(int(p)) if float(p).is_integer() else str(p)
