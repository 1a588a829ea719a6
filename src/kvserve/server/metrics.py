"""Prometheus metrics of one server, named as vLLM's with the ``kvserve:`` prefix.

Engine state (running/waiting, KV usage, preemptions, prefix-cache counters) is read from the
latest SchedulerStats snapshot at scrape time by a custom collector, so the engine thread never
touches Prometheus objects.  Per-request latencies and token counts are observed on the event
loop as outputs reach the server.  Each app gets its own CollectorRegistry: two servers in one
process (tests) never share state.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvserve.step import RequestOutput, SchedulerStats, TierStats

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip


class _EngineStatsCollector(Collector):
    """Gauges and counters straight from the engine's latest stats snapshot."""

    def __init__(
        self,
        stats: Callable[[], SchedulerStats],
        labels: dict[str, str],
        cache_info: dict[str, str],
        tier_block_bytes: dict[str, int],
    ) -> None:
        self._stats = stats
        self._labels = labels
        self._cache_info = cache_info
        self._tier_block_bytes = tier_block_bytes

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        rows = [
            (gauge, "num_requests_running", "Requests in the running batch.", s.num_running),
            (gauge, "num_requests_waiting", "Requests waiting to run.", s.num_waiting),
            (gauge, "kv_cache_usage_perc", "KV cache usage (1 = all blocks used).",
             s.kv_cache_usage),
            (gauge, "kv_cache_waste_perc", "Allocated KV slots of running requests not "
             "holding a token.", s.kv_waste),
            (gauge, "num_free_blocks", "Free KV cache blocks.", s.num_free_blocks),
            (counter, "num_preemptions", "Preemptions since start.", s.num_preemptions),
            (counter, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             s.prefix_cache_queries),
            (counter, "prefix_cache_hits", "Prompt tokens found in the prefix cache.",
             s.prefix_cache_hits),
            (counter, "prefix_store_errors", "Errors that turned the --prefix-cache-dir store "
             "off (serving goes on without it).", s.prefix_store_errors),
        ]  # fmt: skip
        yield from self._families(rows)
        misses = counter(
            "kvserve:prefix_cache_miss_tokens",
            "Prompt tokens not served from the prefix cache, by reason (below_block_size, "
            "isolated, evicted, never_seen).",
            labels=[*self._labels, "reason"],
        )
        for reason, value in s.prefix_cache_misses.items():
            misses.add_metric([*self._labels.values(), reason], value)
        yield misses
        yield self._evicted_by_tier(s)
        yield from self._host_tier(s)
        info = GaugeMetricFamily(
            "kvserve:cache_config_info", "KV cache configuration.", labels=list(self._cache_info)
        )
        info.add_metric(list(self._cache_info.values()), 1.0)
        yield info

    def _evicted_by_tier(self, s: SchedulerStats) -> Metric:
        """The `evicted` misses split by the tier the blocks last fell out of (a family of
        its own: the reason family's series stay as scrapers know them)."""
        family = CounterMetricFamily(
            "kvserve:prefix_cache_evicted_miss_tokens",
            "Prompt tokens missed as evicted, by the lowest tier that held them (device, "
            'host, disk); they sum to prefix_cache_miss_tokens{reason="evicted"}.',
            labels=[*self._labels, "tier"],
        )
        for tier, value in s.prefix_cache_evicted_by_tier.items():
            family.add_metric([*self._labels.values(), tier], value)
        return family

    def _families(self, rows: list[tuple[type, str, str, float]]) -> Iterator[Metric]:
        """One family per (kind, name, help, value) row, with the server's labels."""
        for cls, name, doc, value in rows:
            family = cls(f"kvserve:{name}", doc, labels=list(self._labels))
            family.add_metric(list(self._labels.values()), value)
            yield family

    def _host_tier(self, s: SchedulerStats) -> Iterator[Metric]:
        """The prefix-cache hits of each tier, and the host tier's own figures (zeros without
        --kv-offloading-size)."""
        yield from self._tiers(s)
        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        rows = [
            (gauge, "host_kv_cache_usage_perc", "Host tier usage (1 = every slot holds a block).",
             s.host_kv_cache_usage),
            (gauge, "num_host_blocks", "Blocks the host tier holds at most.", s.num_host_blocks),
            (counter, "kv_offloaded_blocks", "Blocks copied from the KV cache to the host tier.",
             s.num_offloaded_blocks),
            (counter, "kv_loaded_blocks", "Blocks copied back from the host tier (its hits).",
             s.num_loaded_blocks),
            (counter, "kv_events_dropped_batches", "KV event batches never published (the "
             "queue was full or the socket failed): subscribers see a gap in the sequence.",
             s.num_kv_events_dropped_batches),
        ]  # fmt: skip
        yield from self._families(rows)

    def _tiers(self, s: SchedulerStats) -> Iterator[Metric]:
        """Per tier (device, host with --kv-offloading-size, disk with --kv-offloading-dir):
        hits, blocks, bytes, usage, promotions and demotions."""
        tiers = s.tiers or {"device": TierStats(s.prefix_cache_hits, 0, 0, 0, 0)}
        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        families = [
            (counter, "prefix_cache_tier_hits", "Prompt tokens found in the prefix cache, by "
             "tier; they add up to prefix_cache_hits.", lambda t: t.hit_tokens),
            (gauge, "kv_tier_blocks", "Blocks holding K/V, by tier.", lambda t: t.num_blocks),
            (gauge, "kv_tier_capacity_blocks", "Blocks a tier holds at most.",
             lambda t: t.capacity_blocks),
            (gauge, "kv_tier_bytes", "Bytes of the blocks holding K/V, by tier (a compressed "
             "host or disk tier counts its own bytes).", None),
            (gauge, "kv_tier_usage_perc", "Blocks holding K/V / capacity, by tier.",
             lambda t: t.num_blocks / t.capacity_blocks if t.capacity_blocks else 0.0),
            (counter, "kv_tier_promotions", "Blocks copied up out of a tier (its hits).",
             lambda t: t.num_promoted_blocks),
            (counter, "kv_tier_demotions", "Blocks copied into a tier from the one above.",
             lambda t: t.num_demoted_blocks),
            (counter, "kv_tier_lost_blocks", "Blocks a tier listed that did not read back (a "
             "file another server deleted, or corrupt): recomputed.", lambda t: t.num_lost_blocks),
            (counter, "kv_tier_found_blocks", "Blocks another server wrote to the disk tier's "
             "folder that a lookup found.", lambda t: t.num_found_blocks),
        ]  # fmt: skip
        for cls, name, doc, value in families:
            family = cls(f"kvserve:{name}", doc, labels=[*self._labels, "tier"])
            for tier, stats in tiers.items():
                figure = (stats.num_blocks * self._tier_block_bytes.get(tier, 0)
                          if value is None else value(stats))  # fmt: skip
                family.add_metric([*self._labels.values(), tier], figure)
            yield family


class ServerMetrics:
    """The server's registry plus plain running totals for the periodic status log."""

    def __init__(
        self,
        stats: Callable[[], SchedulerStats],
        model_name: str,
        cache_info: dict[str, str] | None = None,
        tier_block_bytes: dict[str, int] | None = None,
    ) -> None:
        """`tier_block_bytes`: the bytes of one block in each tier (kv_tier_bytes)."""
        self.registry = CollectorRegistry()
        self._labels = {"model_name": model_name}
        self.registry.register(_EngineStatsCollector(stats, self._labels, cache_info or {},
                                                     tier_block_bytes or {}))  # fmt: skip
        self.prompt_tokens = self._counter("kvserve:prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = self._counter("kvserve:generation_tokens", "Tokens generated.")
        self._success = Counter(
            "kvserve:request_success",
            "Finished requests by finish reason.",
            [*self._labels, "finished_reason"],
            registry=self.registry,
        )
        self.ttft = self._histogram(
            "kvserve:time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS
        )
        self.itl = self._histogram(
            "kvserve:inter_token_latency_seconds", "Time between tokens.", _ITL_BUCKETS
        )
        self.e2e = self._histogram(
            "kvserve:e2e_request_latency_seconds", "Arrival to last token.", _LATENCY_BUCKETS
        )
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0

    def _counter(self, name: str, doc: str) -> Counter:
        return Counter(name, doc, list(self._labels), registry=self.registry).labels(**self._labels)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        hist = Histogram(name, doc, list(self._labels), buckets=buckets, registry=self.registry)
        return hist.labels(**self._labels)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def start_request(self) -> RequestTracker:
        return RequestTracker(self, time.monotonic())

    def record_finished(self, finish_reasons: list[str | None]) -> None:
        for reason in finish_reasons:
            self._success.labels(**self._labels, finished_reason=reason or "unknown").inc()


class RequestTracker:
    """Observes one request's DELTA outputs (as read): first token, gaps between tokens, end."""

    def __init__(self, metrics: ServerMetrics, arrival: float) -> None:
        self._metrics = metrics
        self._arrival = arrival
        self._last: float | None = None

    def observe(self, output: RequestOutput) -> None:
        now = time.monotonic()
        m = self._metrics
        deltas = [len(c.token_ids) for c in output.outputs]
        num_new = sum(deltas)
        if self._last is None:
            m.ttft.observe(now - self._arrival)
            m.prompt_tokens.inc(len(output.prompt_token_ids))
            m.num_prompt_tokens += len(output.prompt_token_ids)
        elif num_new > 0:
            num_steps = max(deltas)  # a slow reader sees several steps in one output
            for _ in range(num_steps):
                m.itl.observe((now - self._last) / num_steps)
        if num_new > 0:
            m.generation_tokens.inc(num_new)
            m.num_generation_tokens += num_new
        self._last = now
        if output.finished:
            m.e2e.observe(now - self._arrival)
            m.record_finished([c.finish_reason for c in output.outputs])
