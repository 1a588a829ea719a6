"""Helpers of the end-to-end tests: the real `kvserve serve` in a subprocess on a free port
(embedded model, small KV cache), and /metrics scraping."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

SERVER_ARGS = ["--kv-cache-memory", "256MiB", "--max-model-len", "2048"]
START_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ServerProcess:
    process: subprocess.Popen
    port: int
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"server not healthy after {timeout:.0f} s:\n{self.log()[-4000:]}")

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL if it does not exit in time; the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def launch_server(
    log_dir: Path, *extra_args: str, env: dict[str, str] | None = None
) -> ServerProcess:
    """Start (but do not wait for) a server; call wait_healthy() before using it."""
    port = free_port()
    log_path = log_dir / f"server-{port}.log"
    variables = {k: v for k, v in os.environ.items() if k != "KVSERVE_API_KEY"}
    variables.update(env or {})
    command = [sys.executable, "-m", "kvserve.cli", "serve", "--port", str(port),
               *SERVER_ARGS, "--log-stats-interval", "2", *extra_args]  # fmt: skip
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=variables)
    return ServerProcess(process, port, log_path)


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
