"""The result of a run as a printed table (laid out like vLLM's) and as a JSON document.

The JSON holds the summary under vLLM's key names, the memory timeline scraped from
/metrics, the request throughput over time, and one record per request, so a plot or a
comparison can be redone later without rerunning anything.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvserve.bench.metrics import completions_per_second, throughput_bin_s
from kvserve.bench.multi_turn import turn_summary
from kvserve.bench.runner import BenchResult
from kvserve.bench.scrape import MetricsSample

_TITLES = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}
_WIDTH = 50


def summary(result: BenchResult) -> dict[str, Any]:
    """The scalar numbers of a run (vLLM's key names, plus `failed` and `memory`)."""
    m = result.metrics
    row: dict[str, Any] = {
        "completed": m.completed,
        "failed": m.failed,
        "duration": m.duration,
        "total_input_tokens": m.total_input,
        "total_output_tokens": m.total_output,
        "request_throughput": m.request_throughput,
        "output_throughput": m.output_throughput,
        "total_token_throughput": m.total_token_throughput,
        "request_goodput": m.goodput,
    }
    for name, dist in m.distributions.items():
        row.update(dist.as_dict(name))
    if any(r.turn is not None for r in result.records):
        row["turns"] = turn_summary(result.records)
    row["memory"] = memory_summary(result.timeline)
    return row


def memory_summary(timeline: list[MetricsSample]) -> dict[str, Any] | None:
    """Peak and under-pressure KV usage, queue peaks, preemptions, prefix hits and the missed
    prefix-cache tokens by reason over the run."""
    if not timeline:
        return None
    usage = [s.kv_cache_usage for s in timeline]
    pressed = [s.kv_cache_usage for s in timeline if s.num_waiting > 0]
    return {
        "num_samples": len(timeline),
        "peak_kv_cache_usage": max(usage),
        "mean_kv_cache_usage_while_waiting": sum(pressed) / len(pressed) if pressed else None,
        "max_running": max(s.num_running for s in timeline),
        "max_waiting": max(s.num_waiting for s in timeline),
        "preemptions": timeline[-1].num_preemptions - timeline[0].num_preemptions,
        "prefix_hit_rate": timeline[-1].prefix_hit_rate,
        "prefix_cache_miss_tokens": {
            reason: num - timeline[0].prefix_cache_miss_tokens.get(reason, 0.0)
            for reason, num in timeline[-1].prefix_cache_miss_tokens.items()
        },
        "prefix_cache_evicted_by_tier": {
            tier: num - timeline[0].prefix_cache_evicted_by_tier.get(tier, 0.0)
            for tier, num in timeline[-1].prefix_cache_evicted_by_tier.items()
        },
    }


def to_json(result: BenchResult) -> dict[str, Any]:
    config = asdict(result.config)
    dataset = config.pop("dataset")
    return {
        "date": result.date,
        "label": result.config.label,
        "backend": result.config.backend,
        "base_url": result.config.base_url,
        "model": result.model,
        "tokenizer": result.tokenizer,
        "config": {**config, **dataset, "request_rate": _finite(result.config.request_rate)},
        **summary(result),
        "timeline": [s.as_dict() for s in result.timeline],
        "request_throughput_timeline": completions_per_second(
            [r.end_time for r in result.records if r.success],
            result.metrics.duration,
            throughput_bin_s(result.metrics.duration),
        ),
        "requests": [_request_row(r) for r in result.records],
    }


def _request_row(r: Any) -> dict[str, Any]:
    return {
        "success": r.success,
        "input_len": r.input_len,
        "output_len": r.output_len,
        "prompt_len": r.prompt_len,
        "max_tokens": r.expected_output_len,
        "ttft": r.ttft,
        "tpot": r.tpot,
        "itl": r.itl,
        "latency": r.latency,
        "start_time": r.start_time,
        "end_time": r.end_time,
        "error": r.error,
        "cached_tokens": r.cached_tokens,
        "turn": r.turn,
    }


def _finite(value: float) -> float | str:
    """JSON has no infinity; write it as the string vLLM's flag accepts."""
    return "inf" if math.isinf(value) else value


def result_path(result: BenchResult) -> Path:
    """--result-dir / (--result-filename or backend-rate-model-date.json)."""
    config = result.config
    name = config.result_filename
    if name is None:
        rate = _finite(config.request_rate)
        model = result.model.replace("/", "_")
        name = f"{config.label or config.backend}-{rate}qps-{model}-{result.date}.json"
    return Path(config.result_dir or ".") / name


def save_json(result: BenchResult, path: Path | None = None) -> Path:
    path = path or result_path(result)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_json(result), indent=2))
    return path


def format_table(result: BenchResult) -> str:
    """The text block printed at the end of a run."""
    m, config = result.metrics, result.config
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=_WIDTH, c="=")]
    rows: list[tuple[str, Any]] = [
        ("Successful requests:", m.completed),
        ("Failed requests:", m.failed),
        ("Benchmark duration (s):", m.duration),
        ("Total input tokens:", m.total_input),
        ("Total generated tokens:", m.total_output),
        ("Request throughput (req/s):", m.request_throughput),
        ("Output token throughput (tok/s):", m.output_throughput),
        ("Total Token throughput (tok/s):", m.total_token_throughput),
    ]
    if m.goodput is not None:
        rows.append(("Request goodput (req/s):", m.goodput))
    lines += [_line(k, v) for k, v in rows]
    for name in config.selected_metrics():
        title, short = _TITLES[name]
        dist = m.distributions[name]
        lines.append("{s:{c}^{n}}".format(s=title, n=_WIDTH, c="-"))
        lines.append(_line(f"Mean {short} (ms):", dist.mean))
        lines.append(_line(f"Median {short} (ms):", dist.median))
        lines.append(_line(f"Std {short} (ms):", dist.std))
        lines += [_line(f"P{p:g} {short} (ms):", v) for p, v in dist.percentiles.items()]
    if any(r.turn is not None for r in result.records):
        lines += _turn_lines(turn_summary(result.records))
    lines += _memory_lines(memory_summary(result.timeline))
    lines.append("=" * _WIDTH)
    return "\n".join(lines)


def _turn_lines(turns: dict[str, dict[str, float]]) -> list[str]:
    """Multi-turn: TTFT and the cached fraction of the prompt, turn 1 against turns 2+."""
    lines = ["{s:{c}^{n}}".format(s="Turns", n=_WIDTH, c="-")]
    for name, row in turns.items():
        lines.append(_line(f"{name}: count:", row["count"]))
        lines.append(_line(f"{name}: P50 TTFT (ms):", row["ttft_p50_ms"]))
        lines.append(_line(f"{name}: P90 TTFT (ms):", row["ttft_p90_ms"]))
        lines.append(_line(f"{name}: mean cached fraction:", row["mean_cached_fraction"]))
    return lines


def _memory_lines(memory: dict[str, Any] | None) -> list[str]:
    if memory is None:
        return []
    pressed = memory["mean_kv_cache_usage_while_waiting"]
    hit = memory["prefix_hit_rate"]
    return [
        "{s:{c}^{n}}".format(s="KV cache (from /metrics)", n=_WIDTH, c="-"),
        _line("Peak KV cache usage (%):", 100 * memory["peak_kv_cache_usage"]),
        _line("Mean KV usage while queued (%):", "-" if pressed is None else 100 * pressed),
        _line("Max running requests:", int(memory["max_running"])),
        _line("Max waiting requests:", int(memory["max_waiting"])),
        _line("Preemptions:", int(memory["preemptions"])),
        _line("Prefix cache hit rate (%):", "-" if hit is None else 100 * hit),
        *(
            _line(f"Prefix misses {reason} (tokens):", int(num))
            for reason, num in memory.get("prefix_cache_miss_tokens", {}).items()
        ),
        *(
            _line(f"  evicted from {tier} (tokens):", int(num))
            for tier, num in memory.get("prefix_cache_evicted_by_tier", {}).items()
        ),
    ]


def _line(key: str, value: Any) -> str:
    text = f"{value:.2f}" if isinstance(value, float) else str(value)
    return f"{key:<40} {text:<10}"
