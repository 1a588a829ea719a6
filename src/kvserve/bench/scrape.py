"""The server's memory timeline: `/metrics` scraped every half second while the run lasts.

Names are matched after the `prefix:` (kvserve's `kvserve:`, vLLM's `vllm:`), so the same
timeline comes from either server; counters are read with or without `_total`.  A server
without `/metrics` simply yields an empty timeline.  kvserve's missed prefix-cache tokens are
kept by their `reason` label (below_block_size, isolated, evicted, never_seen).
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import asdict, dataclass, field
from urllib.parse import urlsplit

import aiohttp

# timeline field -> metric names accepted (first found wins), after the "prefix:" part
WANTED = {
    "kv_cache_usage": ("kv_cache_usage_perc", "gpu_cache_usage_perc"),
    "num_running": ("num_requests_running",),
    "num_waiting": ("num_requests_waiting",),
    "num_preemptions": ("num_preemptions_total", "num_preemptions"),
    "prefix_cache_queries": ("prefix_cache_queries_total", "prefix_cache_queries"),
    "prefix_cache_hits": ("prefix_cache_hits_total", "prefix_cache_hits"),
}
_LINE = re.compile(r"^(?:[A-Za-z_]\w*:)?([A-Za-z_]\w*)(?:\{[^}]*\})?\s+(\S+)")
_MISS_LINE = re.compile(
    r"^(?:[A-Za-z_]\w*:)?prefix_cache_miss_tokens(?:_total)?\{[^}]*reason=\"(\w+)\"[^}]*\}"
    r"\s+(\S+)"
)
_EVICTED_LINE = re.compile(
    r"^(?:[A-Za-z_]\w*:)?prefix_cache_evicted_miss_tokens(?:_total)?\{[^}]*tier=\"(\w+)\"[^}]*\}"
    r"\s+(\S+)"
)


@dataclass(frozen=True)
class MetricsSample:
    """One scrape.  `t` is seconds since the run started; usage is a fraction (1 = full);
    counters are cumulative since the server started; hit rate is over this run so far."""

    t: float
    kv_cache_usage: float
    num_running: float
    num_waiting: float
    num_preemptions: float
    prefix_cache_queries: float
    prefix_cache_hits: float
    prefix_hit_rate: float | None = None
    prefix_cache_miss_tokens: dict[str, float] = field(default_factory=dict)  # by reason
    # the evicted ones by the tier they fell out of (device, host, disk)
    prefix_cache_evicted_by_tier: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, float | None]:
        return asdict(self)


def metrics_url(base_url: str) -> str:
    """`http://host:port/anything` -> `http://host:port/metrics`."""
    parts = urlsplit(base_url)
    return f"{parts.scheme}://{parts.netloc}/metrics"


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {name without prefix: value}, summed over label sets."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        match = _LINE.match(line)
        if match:
            try:
                value = float(match.group(2))
            except ValueError:
                continue
            values[match.group(1)] = values.get(match.group(1), 0.0) + value
    return values


def parse_miss_reasons(text: str, pattern: re.Pattern[str] = _MISS_LINE) -> dict[str, float]:
    """kvserve's prefix_cache_miss_tokens counter by its reason label ({} for other servers);
    with `pattern` _EVICTED_LINE, its evicted misses by tier (parse_evicted_tiers)."""
    misses: dict[str, float] = {}
    for line in text.splitlines():
        match = pattern.match(line)
        if match:
            try:
                misses[match.group(1)] = misses.get(match.group(1), 0.0) + float(match.group(2))
            except ValueError:
                continue
    return misses


def parse_evicted_tiers(text: str) -> dict[str, float]:
    """kvserve's prefix_cache_evicted_miss_tokens by its tier label ({} for other servers)."""
    return parse_miss_reasons(text, _EVICTED_LINE)


def to_sample(values: dict[str, float], t: float) -> MetricsSample | None:
    """None when the page has none of the metrics (not a kvserve/vLLM server)."""
    fields: dict[str, float] = {}
    for name, candidates in WANTED.items():
        found = [values[c] for c in candidates if c in values]
        fields[name] = found[0] if found else 0.0
    if not any(c in values for names in WANTED.values() for c in names):
        return None
    return MetricsSample(t=t, **fields)


def with_hit_rates(samples: list[MetricsSample]) -> list[MetricsSample]:
    """Hit rate since the first sample: the counters include earlier runs on the server."""
    if not samples:
        return []
    first = samples[0]
    out = []
    for s in samples:
        queries = s.prefix_cache_queries - first.prefix_cache_queries
        rate = (s.prefix_cache_hits - first.prefix_cache_hits) / queries if queries > 0 else None
        out.append(MetricsSample(**{**asdict(s), "prefix_hit_rate": rate}))
    return out


class MetricsScraper:
    """Polls `/metrics` every `interval` seconds until `stop()`; failures are skipped."""

    def __init__(self, url: str, t0: float, interval: float = 0.5) -> None:
        self.url, self.t0, self.interval = url, t0, interval
        self._samples: list[MetricsSample] = []
        self._stopped = asyncio.Event()

    async def run(self, session: aiohttp.ClientSession) -> None:
        while not self._stopped.is_set():
            await self.scrape_once(session)
            try:
                await asyncio.wait_for(self._stopped.wait(), self.interval)
            except TimeoutError:
                pass

    async def scrape_once(self, session: aiohttp.ClientSession) -> None:
        """One sample if the page answers; a missing or broken page is not an error."""
        try:
            timeout = aiohttp.ClientTimeout(total=max(2.0, self.interval * 4))
            async with session.get(self.url, timeout=timeout) as response:
                if response.status != 200:
                    return
                text = await response.text()
        except (aiohttp.ClientError, TimeoutError):
            return
        sample = to_sample(parse_metrics(text), time.perf_counter() - self.t0)
        if sample is not None:
            sample.prefix_cache_miss_tokens.update(parse_miss_reasons(text))
            sample.prefix_cache_evicted_by_tier.update(parse_evicted_tiers(text))
            self._samples.append(sample)

    def stop(self) -> None:
        self._stopped.set()

    def samples(self) -> list[MetricsSample]:
        return with_hit_rates(self._samples)
