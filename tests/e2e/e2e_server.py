"""Helpers of the end-to-end tests: the real `kvserve serve` in a subprocess on a free port
(embedded model, small KV cache; kvserve.bench.launcher does the launching), and /metrics
scraping."""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import httpx

from kvserve.bench.launcher import ServerProcess, free_port, start_server
from kvserve.bench.launcher import launch_server as _launch

__all__ = [
    "SERVER_ARGS", "ServerProcess", "launch_faulty_server", "launch_server", "scrape",
    "wait_for_idle",
]  # fmt: skip

# float32: the tests compare the server's greedy tokens with offline runs batched differently,
# which only float32 keeps exact (--dtype auto would be bfloat16 on a CPU with native bf16).
SERVER_ARGS = ["--kv-cache-memory", "256MiB", "--max-model-len", "2048", "--dtype", "float32"]


def launch_server(
    log_dir: Path, *extra_args: str, env: dict[str, str] | None = None
) -> ServerProcess:
    """Start (but do not wait for) a server without the caller's KVSERVE_API_KEY, `env` added;
    call wait_healthy() before using it."""
    variables = {k: v for k, v in os.environ.items() if k != "KVSERVE_API_KEY"}
    variables.update(env or {})
    args = [*SERVER_ARGS, "--log-stats-interval", "2", *extra_args]
    return _launch(log_dir, args, env=variables)


def launch_faulty_server(
    log_dir: Path, poison: int, *extra_args: str, env: dict[str, str] | None = None
) -> ServerProcess:
    """tests/e2e/faulty_server.py (a step computing token `poison` raises, or hangs with
    KVSERVE_TEST_POISON_HANG=1 in `env`), healthy when this returns; the caller stops it."""
    port = free_port()
    script = Path(__file__).with_name("faulty_server.py")
    command = [sys.executable, str(script), "serve", "--port", str(port), *SERVER_ARGS,
               *extra_args]  # fmt: skip
    variables = {k: v for k, v in os.environ.items() if k != "KVSERVE_API_KEY"}
    variables.update({"KVSERVE_TEST_POISON_TOKEN": str(poison), **(env or {})})
    server = start_server(command, port, log_dir, variables)
    try:
        server.wait_healthy()
    except BaseException:
        server.stop()
        raise
    return server


_METRIC_LINE = re.compile(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})? (\S+)$")


def scrape(base_url: str) -> dict[str, float]:
    """/metrics as {name: value}, labels dropped (one model per server)."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    values = {}
    for line in text.splitlines():
        match = _METRIC_LINE.match(line)
        if match:
            values[match.group(1)] = float(match.group(3))
    return values


def wait_for_idle(base_url: str, timeout: float = 10.0) -> dict[str, float]:
    """Poll /metrics until nothing runs or waits and the KV cache is empty again."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = scrape(base_url)
        idle = (
            metrics["kvserve:num_requests_running"] == 0
            and metrics["kvserve:num_requests_waiting"] == 0
            and metrics["kvserve:kv_cache_usage_perc"] == 0
        )
        if idle or time.monotonic() > deadline:
            return metrics
        time.sleep(0.2)
