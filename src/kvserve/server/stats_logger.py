"""A one-line status every few seconds while the server is busy, as vLLM logs it:

    Avg prompt throughput: 812.3 tokens/s, Avg generation throughput: 95.1 tokens/s,
    Running: 12 reqs, Waiting: 3 reqs, KV cache usage: 41.2%, Prefix cache hit rate: 63.0%,
    Prefix cache misses (tokens): below_block_size 40, isolated 0, evicted 96, never_seen 512

(the misses of the interval by reason, kv/miss_reasons.py; left out when there were none)

Silent while idle, so an idle server's log stays quiet.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvserve.server.metrics import ServerMetrics
from kvserve.step import SchedulerStats

logger = logging.getLogger("kvserve")


@dataclass(frozen=True)
class _Totals:
    at: float
    prompt_tokens: int
    generation_tokens: int
    prefix_queries: int
    prefix_hits: int
    preemptions: int
    prefix_misses: dict[str, int]


class StatsLogger:
    """Compares the totals now with those of the previous line."""

    def __init__(
        self, metrics: ServerMetrics, stats: Callable[[], SchedulerStats], interval: float
    ) -> None:
        self._metrics = metrics
        self._stats = stats
        self.interval = interval
        self._previous = self._totals(stats())

    def _totals(self, stats: SchedulerStats) -> _Totals:
        return _Totals(
            at=time.monotonic(),
            prompt_tokens=self._metrics.num_prompt_tokens,
            generation_tokens=self._metrics.num_generation_tokens,
            prefix_queries=stats.prefix_cache_queries,
            prefix_hits=stats.prefix_cache_hits,
            preemptions=stats.num_preemptions,
            prefix_misses=dict(stats.prefix_cache_misses),
        )

    def status_line(self) -> str | None:
        """The line for the interval since the previous call, or None when idle throughout."""
        stats = self._stats()
        now, before = self._totals(stats), self._previous
        self._previous = now
        new_prompt = now.prompt_tokens - before.prompt_tokens
        new_generated = now.generation_tokens - before.generation_tokens
        if not (stats.num_running or stats.num_waiting or new_prompt or new_generated):
            return None
        seconds = max(now.at - before.at, 1e-9)
        queries = now.prefix_queries - before.prefix_queries
        hits = now.prefix_hits - before.prefix_hits
        if queries == 0:  # nothing admitted this interval: show the rate since start
            queries, hits = now.prefix_queries, now.prefix_hits
        line = (
            f"Avg prompt throughput: {new_prompt / seconds:.1f} tokens/s, "
            f"Avg generation throughput: {new_generated / seconds:.1f} tokens/s, "
            f"Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, "
            f"KV cache usage: {stats.kv_cache_usage:.1%}, "
            f"Prefix cache hit rate: {hits / queries if queries else 0.0:.1%}"
        )
        misses = {r: n - before.prefix_misses.get(r, 0) for r, n in now.prefix_misses.items()}
        if any(misses.values()):
            split = ", ".join(f"{reason} {num}" for reason, num in misses.items())
            line += f", Prefix cache misses (tokens): {split}"
        if stats.num_host_blocks:
            line += f", Host KV usage: {stats.host_kv_cache_usage:.1%}"
        preempted = now.preemptions - before.preemptions
        if preempted:
            line += f", Preemptions: {preempted}"
        return line

    async def run(self) -> None:
        """Log every `interval` seconds until cancelled."""
        while True:
            await asyncio.sleep(self.interval)
            line = self.status_line()
            if line is not None:
                logger.info(line)
