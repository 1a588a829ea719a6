"""Miss reasons on their way out: /metrics (one counter, a reason label), the periodic status
line, and `kvserve bench serve`'s scrape and report."""

from __future__ import annotations

from dataclasses import replace

from kvserve.bench.report import _memory_lines, memory_summary
from kvserve.bench.scrape import parse_metrics, parse_miss_reasons, to_sample
from kvserve.server.metrics import ServerMetrics
from kvserve.server.stats_logger import StatsLogger
from kvserve.step import SchedulerStats, TierStats

MISSES = {"below_block_size": 3, "isolated": 32, "evicted": 0, "never_seen": 48}


def stats(**kw) -> SchedulerStats:
    base = SchedulerStats(1, 0, 0.5, 10, 0, 100, 17, 0.0, dict(MISSES))
    return replace(base, **kw)


def test_metrics_expose_one_counter_per_reason_and_bench_reads_them_back():
    metrics = ServerMetrics(lambda: stats(), "m")
    text = metrics.exposition().decode()
    assert 'kvserve:prefix_cache_miss_tokens_total{model_name="m",reason="isolated"} 32.0' in text
    assert parse_miss_reasons(text) == {k: float(v) for k, v in MISSES.items()}
    first = to_sample(parse_metrics(text), 0.0)
    last = to_sample(parse_metrics(text), 1.0)
    first.prefix_cache_miss_tokens.update(parse_miss_reasons(text))
    last.prefix_cache_miss_tokens.update({**parse_miss_reasons(text), "never_seen": 148.0})
    summary = memory_summary([first, last])
    assert summary["prefix_cache_miss_tokens"]["never_seen"] == 100.0
    assert summary["prefix_cache_miss_tokens"]["isolated"] == 0.0
    lines = _memory_lines(summary)
    assert any(line.startswith("Prefix misses never_seen (tokens):") for line in lines)


def test_status_line_splits_the_interval_misses_by_reason():
    current = [stats(prefix_cache_misses=dict.fromkeys(MISSES, 0))]
    metrics = ServerMetrics(lambda: current[0], "m")
    logger = StatsLogger(metrics, lambda: current[0], 5.0)
    assert "Prefix cache misses" not in logger.status_line()
    current[0] = stats()
    line = logger.status_line()
    assert line.endswith(
        "Prefix cache misses (tokens): below_block_size 3, isolated 32, evicted 0, never_seen 48"
    )


def test_metrics_split_the_hits_by_tier_and_show_the_host_tier():
    tiers = {"device": TierStats(5, 10, 20, 0, 0), "host": TierStats(12, 16, 64, 3, 16),
             "disk": TierStats(4, 30, 100, 1, 20, 2, 7)}  # fmt: skip
    host = dict(prefix_cache_host_hits=12, num_host_blocks=64, host_kv_cache_usage=0.25,
                num_offloaded_blocks=16, num_loaded_blocks=3, tiers=tiers)  # fmt: skip
    block_bytes = {"device": 1000, "host": 300, "disk": 300}
    text = ServerMetrics(lambda: stats(**host), "m", None, block_bytes).exposition().decode()

    def value(name: str, tier: str) -> str:
        return f'kvserve:{name}{{model_name="m",tier="{tier}"}}'

    assert f"{value('prefix_cache_tier_hits_total', 'device')} 5.0" in text
    assert f"{value('prefix_cache_tier_hits_total', 'host')} 12.0" in text
    assert f"{value('prefix_cache_tier_hits_total', 'disk')} 4.0" in text
    assert f"{value('kv_tier_bytes', 'device')} 10000.0" in text
    assert f"{value('kv_tier_bytes', 'disk')} 9000.0" in text
    assert f"{value('kv_tier_usage_perc', 'host')} 0.25" in text
    assert f"{value('kv_tier_capacity_blocks', 'disk')} 100.0" in text
    assert f"{value('kv_tier_promotions_total', 'host')} 3.0" in text
    assert f"{value('kv_tier_demotions_total', 'disk')} 20.0" in text
    assert f"{value('kv_tier_lost_blocks_total', 'disk')} 2.0" in text
    assert f"{value('kv_tier_found_blocks_total', 'disk')} 7.0" in text
    assert 'kvserve:host_kv_cache_usage_perc{model_name="m"} 0.25' in text
    assert 'kvserve:kv_offloaded_blocks_total{model_name="m"} 16.0' in text
    assert 'kvserve:kv_loaded_blocks_total{model_name="m"} 3.0' in text


def test_status_line_shows_the_host_tier_usage_only_with_a_host_tier():
    current = [stats()]
    metrics = ServerMetrics(lambda: current[0], "m")
    logger = StatsLogger(metrics, lambda: current[0], 5.0)
    assert "Host KV usage" not in logger.status_line()
    current[0] = stats(num_host_blocks=64, host_kv_cache_usage=0.25)
    assert "Host KV usage: 25.0%" in logger.status_line()
