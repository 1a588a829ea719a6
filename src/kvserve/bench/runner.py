"""`kvserve bench serve` as a Python API: `bench_serve(BenchConfig(...)) -> BenchResult`.

Requests leave at arrival times drawn up front (gamma inter-arrival gaps: shape =
burstiness, mean = 1 / rate; inf = all at time 0), wait for a slot when --max-concurrency is
set, and are timed one by one; meanwhile a scraper samples the server's /metrics.  The run's
duration is from the first send to the last response.  The multi-turn dataset sends its
conversations' turns instead (bench/multi_turn.py).
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
from tqdm import tqdm

from kvserve.bench.client import RequestSpec, send_request
from kvserve.bench.config import BenchConfig
from kvserve.bench.datasets import SampleRequest, as_text, sample_requests
from kvserve.bench.metrics import BenchmarkMetrics, RequestRecord, compute_metrics
from kvserve.bench.multi_turn import Conversation, conversations, run_conversations
from kvserve.bench.scrape import MetricsSample, MetricsScraper, metrics_url
from kvserve.errors import ParameterError

REQUEST_TIMEOUT_S = 6 * 3600


@dataclass
class BenchResult:
    """A finished run: what was asked, what each request did, the summary, the timeline."""

    config: BenchConfig
    model: str
    tokenizer: str
    records: list[RequestRecord]
    metrics: BenchmarkMetrics
    timeline: list[MetricsSample]
    date: str = field(default_factory=lambda: datetime.now().strftime("%Y%m%d-%H%M%S"))


def arrival_offsets(num: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send time of each request in seconds from the start; the first leaves at 0."""
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed)
    scale = 1.0 / (rate * burstiness)  # mean gap = shape x scale = 1 / rate
    offsets, t = [], 0.0
    for _ in range(num):
        offsets.append(t)
        t += rng.gammavariate(burstiness, scale)
    return offsets


def bench_serve(config: BenchConfig, tokenizer: Any | None = None) -> BenchResult:
    """Run a whole benchmark (blocking).  Pass `tokenizer` to skip loading one."""
    model = config.model or fetch_model_name(config.base_url)
    if tokenizer is None:
        tokenizer = load_bench_tokenizer(config.tokenizer, model)
    count = _token_counter(tokenizer)
    if config.dataset.dataset_name == "multi-turn":
        chats = conversations(config.dataset, tokenizer)
        records, duration, timeline = asyncio.run(run_chats(config, model, chats, count))
    else:
        samples = sample_requests(config.dataset, tokenizer)
        if config.backend == "openai-chat":
            samples = [as_text(s, tokenizer) for s in samples]
        records, duration, timeline = asyncio.run(run_requests(config, model, samples, count))
    metrics = compute_metrics(records, duration, config.percentiles(), config.slos_ms())
    name = getattr(tokenizer, "name_or_path", "") or str(config.tokenizer)
    return BenchResult(config, model, name, records, metrics, timeline)


async def run_requests(
    config: BenchConfig,
    model: str,
    samples: list[SampleRequest],
    count_tokens: Callable[[str], int] | None = None,
) -> tuple[list[RequestRecord], float, list[MetricsSample]]:
    """Send every sample on schedule; (records in sample order, duration, timeline)."""
    offsets = arrival_offsets(
        len(samples), config.request_rate, config.burstiness, config.dataset.seed
    )
    limit = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    bar = tqdm(total=len(samples), disable=config.disable_tqdm, desc="requests")

    async def send_all(session: aiohttp.ClientSession, t0: float) -> list[RequestRecord]:
        spec = _spec(config, model)

        async def one(sample: SampleRequest, offset: float) -> RequestRecord:
            await asyncio.sleep(max(0.0, offset - (time.perf_counter() - t0)))
            if limit is None:
                record = await send_request(session, spec, sample, t0, count_tokens)
            else:
                async with limit:
                    record = await send_request(session, spec, sample, t0, count_tokens)
            bar.update(1)
            return record

        pairs = zip(samples, offsets, strict=True)
        return list(await asyncio.gather(*(one(s, o) for s, o in pairs)))

    result = await _scraped(config, send_all)
    bar.close()
    return result


async def run_chats(
    config: BenchConfig,
    model: str,
    chats: list[Conversation],
    count_tokens: Callable[[str], int] | None = None,
) -> tuple[list[RequestRecord], float, list[MetricsSample]]:
    """Every turn of every conversation, --max-concurrency conversations at a time (all when
    unset; --request-rate does not apply); (records by conversation and turn, duration,
    timeline)."""
    data = config.dataset
    bar = tqdm(total=len(chats) * data.num_turns, disable=config.disable_tqdm, desc="turns")

    async def send_all(session: aiohttp.ClientSession, t0: float) -> list[RequestRecord]:
        return await run_conversations(session, _spec(config, model), data, chats,
                                       config.max_concurrency or len(chats), t0, count_tokens,
                                       lambda: bar.update(1))  # fmt: skip

    result = await _scraped(config, send_all)
    bar.close()
    return result


def _spec(config: BenchConfig, model: str) -> RequestSpec:
    return RequestSpec(config.api_url, model, config.backend, config.ignore_eos, api_key=_api_key(),
                       sampling=tuple(config.sampling().items()))  # fmt: skip


async def _scraped(
    config: BenchConfig,
    send_all: Callable[[aiohttp.ClientSession, float], Awaitable[list[RequestRecord]]],
) -> tuple[list[RequestRecord], float, list[MetricsSample]]:
    """`send_all(session, t0)` while a scraper samples /metrics; (records, duration from t0
    to the last response, timeline)."""
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=timeout
    ) as session:
        t0 = time.perf_counter()
        scraper = MetricsScraper(metrics_url(config.base_url), t0, config.scrape_interval)
        scraping = asyncio.create_task(scraper.run(session))
        records = await send_all(session, t0)
        duration = time.perf_counter() - t0
        scraper.stop()
        await scraping
        await scraper.scrape_once(session)  # the state right after the last response
    return records, duration, scraper.samples()


def fetch_model_name(base_url: str) -> str:
    """The first model the server lists (what `--model` defaults to)."""
    import httpx

    url = base_url.rstrip("/") + "/v1/models"
    headers = {"Authorization": f"Bearer {key}"} if (key := _api_key()) else {}
    try:
        response = httpx.get(url, timeout=30, headers=headers)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise ParameterError(
            "--model", f"not given and {url} did not name one ({exc}); pass --model"
        ) from None


def load_bench_tokenizer(tokenizer: str | None, model: str) -> Any:
    """--tokenizer, else the embedded model's (when MODEL is it), else MODEL as a path."""
    from kvserve.models.paths import EMBEDDED_NAME, embedded_model_path
    from kvserve.tokenizer import load_tokenizer

    if tokenizer is not None:
        path = Path(tokenizer).expanduser()
    elif model == EMBEDDED_NAME:
        path = embedded_model_path()
    else:
        path = Path(model).expanduser()
    if not path.exists():
        raise ParameterError(
            "--tokenizer",
            f"no tokenizer for model {model!r}; pass --tokenizer "
            "with a HF directory or a GGUF file",
        )
    return load_tokenizer(path)


def _token_counter(tokenizer: Any) -> Callable[[str], int]:
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))


def _api_key() -> str | None:
    """The OpenAI client's convention (vLLM's benchmark reads the same variable)."""
    import os

    return os.environ.get("OPENAI_API_KEY") or None
