"""`kvserve bench serve` against the real `kvserve serve` (embedded model, small KV cache):
every request completes, token counts are exact, the JSON and the plot are written, and the
memory timeline came from the server's /metrics."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from e2e_server import ServerProcess

from kvserve.cli import main

NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 16, 32, 8


@pytest.fixture(scope="module")
def server(server_factory) -> Iterator[ServerProcess]:
    server = server_factory("--kv-cache-memory", "128MiB", "--max-model-len", "1024",
                            "--disable-uvicorn-access-log")  # fmt: skip
    server.wait_healthy(120)
    yield server


def test_bench_serve_against_kvserve(server: ServerProcess, tmp_path, capsys) -> None:
    png = tmp_path / "timeline.png"
    code = main([
        "bench", "serve", "--base-url", server.base_url, "--dataset-name", "random",
        "--num-prompts", str(NUM_PROMPTS), "--random-input-len", str(INPUT_LEN),
        "--random-output-len", str(OUTPUT_LEN), "--ignore-eos", "--save-result",
        "--result-dir", str(tmp_path), "--result-filename", "bench.json", "--plot", str(png),
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--goodput", "e2el:600000", "--disable-tqdm",
        # 16 short requests finish in about a second: at the default 0.5 s between scrapes,
        # the timeline missed every moment with a request running (once, in a full CPU run).
        "--scrape-interval", "0.05",
    ])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert "Serving Benchmark Result" in out
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert (doc["completed"], doc["failed"]) == (NUM_PROMPTS, 0)
    assert doc["total_input_tokens"] == NUM_PROMPTS * INPUT_LEN
    assert doc["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    assert doc["model"] == "SmolLM2-135M-Instruct"
    assert doc["request_goodput"] == doc["request_throughput"]  # a 10-minute SLO: all meet it
    for row in doc["requests"]:
        assert row["success"] and row["error"] == ""
        assert (row["input_len"], row["output_len"]) == (INPUT_LEN, OUTPUT_LEN)
        assert 0 < row["ttft"] <= row["latency"]
        assert 1 <= len(row["itl"]) <= OUTPUT_LEN - 1  # a chunk may carry several tokens
    assert doc["timeline"], "no /metrics samples"
    assert max(s["num_running"] for s in doc["timeline"]) > 0
    assert max(s["kv_cache_usage"] for s in doc["timeline"]) > 0
    assert doc["memory"]["preemptions"] == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_sampled_bench_run_completes_with_exact_token_counts(server: ServerProcess, tmp_path):
    """With --temperature, --top-p and --top-k (sent in every body: test_bench_inputs), the
    real server samples and every request streams its exact length."""
    code = main([
        "bench", "serve", "--base-url", server.base_url, "--dataset-name", "random",
        "--num-prompts", "8", "--random-input-len", str(INPUT_LEN), "--random-output-len",
        str(OUTPUT_LEN), "--ignore-eos", "--temperature", "0.8", "--top-p", "0.9", "--top-k",
        "40", "--save-result", "--result-dir", str(tmp_path), "--result-filename", "s.json",
        "--disable-tqdm",
    ])  # fmt: skip
    assert code == 0
    doc = json.loads((tmp_path / "s.json").read_text())
    assert (doc["completed"], doc["failed"]) == (8, 0)
    assert doc["total_output_tokens"] == 8 * OUTPUT_LEN
