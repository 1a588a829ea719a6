"""`kvserve bench serve` against a scripted fake server (aiohttp, in-process, free port).

Each scripted request says in its prompt how the server answers it: prompt = [TTFT ms, ITL ms,
mode, filler...], max_tokens = chunks of one token each.  Delays are 50-400 ms so the
timing assertions hold with ~20 ms tolerance on a busy 2-core machine; the arithmetic from
records to summary is checked exactly.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from kvserve.bench.config import BenchConfig, DatasetConfig
from kvserve.bench.datasets import SampleRequest
from kvserve.bench.metrics import compute_metrics, percentile
from kvserve.bench.plot import plot_timeline
from kvserve.bench.report import format_table, save_json, summary, to_json
from kvserve.bench.runner import BenchResult, run_requests

TOL_S = 0.02  # timing tolerance on a noisy machine
SETUP_S = 0.04  # a new connection and request parsing, on a busy 2-core machine
OK, HTTP_500, DROP, ERROR_EVENT, NO_USAGE = range(5)
STATE = web.AppKey("state", "FakeState")


@dataclass
class FakeState:
    """What /metrics reports: requests in flight, a growing preemption and prefix count."""

    running: int = 0
    capacity: int = 4
    preemptions: int = 0
    queries: int = 0
    hits: int = 0
    serve_metrics: bool = True
    writes: dict[int, list[float]] = field(default_factory=dict)  # tag -> [entry, chunk...]


def _chunk(text: str, chat: bool) -> bytes:
    choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
    return f"data: {json.dumps({'choices': [choice]})}\n\n".encode()


async def _completions(request: web.Request) -> web.StreamResponse:
    """Both APIs; a chat prompt is the same script written as text: "ttft,itl,mode,tag"."""
    state: FakeState = request.app[STATE]
    entry = time.perf_counter()
    body = await request.json()
    chat = "messages" in body
    if chat:
        prompt = [int(x) for x in body["messages"][0]["content"].split(",")]
    else:
        prompt = body["prompt"]
    n = body["max_tokens"]
    writes = state.writes.setdefault(prompt[3], [entry])
    ttft_ms, itl_ms, mode = (
        (prompt[0], prompt[1], prompt[2]) if body["model"] == "scripted" else (20, 10, OK)
    )
    if mode == HTTP_500:
        return web.json_response({"error": {"message": "boom"}}, status=500)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    state.running += 1
    state.queries += len(prompt)
    state.hits += len(prompt) // 2
    if chat:  # the role arrives at once and carries no token: it must not count as TTFT
        await response.write(
            b'data: {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}\n\n'
        )
    try:
        await asyncio.sleep(ttft_ms / 1000)
        for i in range(n):
            if i:
                await asyncio.sleep(itl_ms / 1000)
            await response.write(_chunk(f"t{i} ", chat))
            writes.append(time.perf_counter())
            if mode == DROP and i == 1:
                request.transport.close()  # the connection dies mid-stream
                return response
        if mode == ERROR_EVENT:
            await response.write(b'data: {"error": {"message": "engine died", "code": 503}}\n\n')
        elif mode != NO_USAGE:
            usage = {"prompt_tokens": len(prompt), "completion_tokens": n}
            await response.write(
                f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
            )
        await response.write(b"data: [DONE]\n\n")
    finally:
        state.running -= 1
    return response


async def _metrics(request: web.Request) -> web.Response:
    s: FakeState = request.app[STATE]
    if not s.serve_metrics:
        raise web.HTTPNotFound()
    s.preemptions += 1
    labels = '{model_name="fake"}'
    text = "\n".join(
        [
            "# HELP kvserve:kv_cache_usage_perc KV cache usage.",
            "# TYPE kvserve:kv_cache_usage_perc gauge",
            f"kvserve:kv_cache_usage_perc{labels} {s.running / s.capacity}",
            f"kvserve:num_requests_running{labels} {s.running}",
            f"kvserve:num_requests_waiting{labels} 0.0",
            f"kvserve:num_preemptions_total{labels} {s.preemptions}",
            f"kvserve:num_preemptions_created{labels} 1.7e9",
            f"kvserve:prefix_cache_queries_total{labels} {s.queries}",
            f"kvserve:prefix_cache_hits_total{labels} {s.hits}",
        ]
    )
    return web.Response(text=text + "\n")


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "fake-model"}]})


@pytest.fixture(scope="module")
def fake_server() -> Iterator[tuple[str, FakeState]]:
    """(base_url, state) of a fake OpenAI server running on its own thread and loop."""
    state = FakeState()
    app = web.Application()
    app[STATE] = state
    app.add_routes(
        [
            web.post("/v1/completions", _completions),
            web.get("/metrics", _metrics),
            web.get("/v1/models", _models),
            web.post("/v1/chat/completions", _completions),
        ]
    )
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    ready = threading.Event()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(10)
    yield f"http://127.0.0.1:{port}", state
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def scripted(
    ttft_ms: int, itl_ms: int, num_tokens: int, mode: int = OK, tag: int = -1
) -> SampleRequest:
    """A prompt telling the fake server how to answer; `tag` keys its write times."""
    prompt = [ttft_ms, itl_ms, mode, tag, 7, 7]
    return SampleRequest(prompt=prompt, prompt_len=len(prompt), output_len=num_tokens)


def run(base_url: str, samples: list[SampleRequest], **kwargs) -> BenchResult:
    config = BenchConfig(
        base_url=base_url,
        model="scripted",
        disable_tqdm=True,
        dataset=DatasetConfig(num_prompts=len(samples)),
        **kwargs,
    )
    records, duration, timeline = asyncio.run(run_requests(config, "scripted", samples))
    metrics = compute_metrics(records, duration, config.percentiles(), config.slos_ms())
    return BenchResult(config, "scripted", "none", records, metrics, timeline)


def test_timing_and_every_reported_number(fake_server, tmp_path) -> None:
    base_url, state = fake_server
    shapes = [(50, 50, 5), (150, 60, 4), (250, 70, 3), (350, 80, 2)]  # TTFT, ITL, tokens
    samples = [scripted(*shape, tag=100 + i) for i, shape in enumerate(shapes)]
    result = run(
        base_url,
        samples,
        metric_percentiles="50,90,99",
        percentile_metrics="ttft,tpot,itl,e2el",
        goodput=("ttft:200",),
    )
    records, m = result.records, result.metrics
    for i, (record, (ttft_ms, itl_ms, n)) in enumerate(zip(records, shapes, strict=True)):
        assert record.success, record.error
        assert (record.input_len, record.output_len) == (6, n)
        entry, *chunks = state.writes[100 + i]  # what the server did, on the same clock
        assert chunks[0] - entry >= ttft_ms / 1000 - 0.002  # asyncio.sleep is never early
        # TTFT = the server's time to its first chunk + connection set-up and delivery
        assert chunks[0] - entry <= record.ttft <= chunks[0] - entry + SETUP_S
        assert record.ttft == pytest.approx(ttft_ms / 1000, abs=SETUP_S + TOL_S)
        server_gaps = [b - a for a, b in zip(chunks, chunks[1:], strict=False)]
        assert len(record.itl) == n - 1
        assert record.itl == pytest.approx(server_gaps, abs=TOL_S)
        assert record.itl == pytest.approx([itl_ms / 1000] * (n - 1), abs=2 * TOL_S)
        tail = record.latency - record.ttft - sum(record.itl)  # usage chunk and [DONE]
        assert 0 <= tail <= TOL_S
        assert record.tpot == (record.latency - record.ttft) / (n - 1)
        assert record.tpot == pytest.approx(sum(server_gaps) / (n - 1), abs=TOL_S)
    # all four leave at once: the run lasts as long as the slowest (350 + 80 ms)
    slowest = max(r.end_time for r in records)
    assert slowest <= m.duration <= slowest + TOL_S
    assert 0.43 <= m.duration <= 0.43 + SETUP_S + 2 * TOL_S
    assert (m.completed, m.failed, m.total_input, m.total_output) == (4, 0, 24, 14)
    assert m.request_throughput == 4 / m.duration
    assert m.output_throughput == 14 / m.duration
    assert m.total_token_throughput == 38 / m.duration
    assert m.goodput == 2 / m.duration  # TTFT 50 and 150 ms meet ttft:200
    ttft_ms = [r.ttft * 1000 for r in records]
    d = m.distributions["ttft"]
    assert d.mean == sum(ttft_ms) / 4
    assert d.median == percentile(ttft_ms, 50)
    assert d.percentiles[99.0] == percentile(ttft_ms, 99)
    third, fourth = sorted(ttft_ms)[2:]
    assert d.percentiles[99.0] == pytest.approx(0.03 * third + 0.97 * fourth, rel=1e-12)
    itl_ms = [g * 1000 for r in records for g in r.itl]
    assert len(itl_ms) == 4 + 3 + 2 + 1
    assert m.distributions["itl"].percentiles[90.0] == percentile(itl_ms, 90)
    e2el = m.distributions["e2el"]
    assert e2el.mean == pytest.approx(sum(r.latency for r in records) * 1000 / 4)

    doc = to_json(result)
    assert [row["output_len"] for row in doc["requests"]] == [5, 4, 3, 2]
    assert doc["requests"][0]["itl"] == records[0].itl
    assert doc["p90_itl_ms"] == m.distributions["itl"].percentiles[90.0]
    assert doc["request_goodput"] == m.goodput
    table = format_table(result)
    assert "Serving Benchmark Result" in table and "P90 ITL (ms):" in table
    assert "Request goodput (req/s):" in table
    path = save_json(result, tmp_path / "r.json")
    assert json.loads(path.read_text())["completed"] == 4


def test_max_concurrency_serializes_requests(fake_server) -> None:
    base_url, _ = fake_server
    result = run(base_url, [scripted(60, 50, 2) for _ in range(3)], max_concurrency=1)
    records = result.records
    for before, after in zip(records, records[1:], strict=False):
        assert after.start_time >= before.end_time - 0.005
    assert 3 * 0.11 <= result.metrics.duration <= 3 * (0.11 + SETUP_S)


def test_failures_are_counted_and_the_run_still_reports(fake_server, tmp_path) -> None:
    base_url, _ = fake_server
    samples = [
        scripted(50, 50, 3),
        scripted(50, 50, 3, HTTP_500),
        scripted(50, 50, 5, DROP),
        scripted(50, 50, 2, ERROR_EVENT),
    ]
    result = run(base_url, samples)
    ok, http500, dropped, errored = result.records
    assert ok.success and ok.output_len == 3
    assert not http500.success and http500.error.startswith("HTTP 500") and "boom" in http500.error
    assert not dropped.success and dropped.error
    assert not errored.success and "engine died" in errored.error
    m = result.metrics
    assert (m.completed, m.failed, m.total_output) == (1, 3, 3)
    assert m.distributions["ttft"].mean == pytest.approx(ok.ttft * 1000)
    doc = json.loads(save_json(result, tmp_path / "f.json").read_text())
    assert [r["success"] for r in doc["requests"]] == [True, False, False, False]
    assert doc["requests"][1]["error"].startswith("HTTP 500")
    assert "Failed requests:                         3" in format_table(result)


def test_without_usage_the_client_counts_chunks(fake_server) -> None:
    base_url, _ = fake_server
    result = run(base_url, [scripted(50, 50, 4, NO_USAGE)])
    record = result.records[0]
    assert record.success and record.output_len == 4 and record.input_len == 6


def test_timeline_is_scraped_and_drawn(fake_server, tmp_path) -> None:
    base_url, _ = fake_server
    result = run(base_url, [scripted(300, 100, 8) for _ in range(4)], scrape_interval=0.1)
    timeline = result.timeline
    assert len(timeline) >= 8  # ~1 s of run at 0.1 s, plus the final scrape
    assert max(s.num_running for s in timeline) == 4
    assert max(s.kv_cache_usage for s in timeline) == 1.0
    assert timeline[-1].num_running == 0
    assert timeline[-1].prefix_hit_rate == pytest.approx(0.5)
    assert [s.t for s in timeline] == sorted(s.t for s in timeline)
    memory = summary(result)["memory"]
    assert memory["max_running"] == 4 and memory["preemptions"] == len(timeline) - 1
    png = plot_timeline(to_json(result), tmp_path / "t.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_server_without_metrics_gives_an_empty_timeline(fake_server) -> None:
    base_url, state = fake_server
    state.serve_metrics = False
    try:
        result = run(base_url, [scripted(50, 50, 2)])
    finally:
        state.serve_metrics = True
    assert result.records[0].success
    assert result.timeline == [] and summary(result)["memory"] is None


def test_cli_with_the_embedded_tokenizer(fake_server, tmp_path, capsys) -> None:
    """The whole command: random token-id prompts, table, JSON, plot."""
    from kvserve.cli import main

    base_url, _ = fake_server
    png = tmp_path / "run.png"
    code = main(
        [
            "bench",
            "serve",
            "--base-url",
            base_url,
            "--model",
            "SmolLM2-135M-Instruct",
            "--num-prompts",
            "4",
            "--random-input-len",
            "16",
            "--random-output-len",
            "3",
            "--save-result",
            "--result-dir",
            str(tmp_path),
            "--result-filename",
            "run.json",
            "--plot",
            str(png),
            "--disable-tqdm",
            "--metric-percentiles",
            "50,99",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "Successful requests:                     4" in out and "P50 TTFT (ms):" in out
    doc = json.loads((tmp_path / "run.json").read_text())
    assert (doc["total_input_tokens"], doc["total_output_tokens"]) == (64, 12)
    assert doc["config"]["request_rate"] == "inf" and doc["timeline"]
    assert png.is_file()


def test_chat_backend_times_content_not_the_role_chunk(fake_server) -> None:
    base_url, state = fake_server
    sample = SampleRequest(prompt="200,50,0,300", prompt_len=4, output_len=3)
    result = run(base_url, [sample], backend="openai-chat")
    record = result.records[0]
    entry, *chunks = state.writes[300]
    assert record.success and record.output_len == 3 and record.generated_text == "t0 t1 t2 "
    assert chunks[0] - entry <= record.ttft <= chunks[0] - entry + SETUP_S
    assert record.ttft >= 0.198 and len(record.itl) == 2
