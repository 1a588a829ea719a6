"""`kvserve serve` in a subprocess on a free port, for the end-to-end tests and the benchmark
scripts: started with its output in a log file, waited on until /health answers, stopped with
SIGTERM (then SIGKILL if it does not exit in time)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_command(port: int, args: Sequence[str] = ()) -> list[str]:
    """`kvserve serve --port PORT ARGS...` with this interpreter."""
    return [sys.executable, "-m", "kvserve.cli", "serve", "--port", str(port), *args]


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
        """Poll /health until it answers 200; RuntimeError (with the log) if the server exits
        first or `timeout` seconds pass."""
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

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM, then SIGKILL if it does not exit in time, to the server's whole process
        group (a server may have children: compile workers, another engine's processes, the
        shell of a command line); the exit code."""
        if self.process.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.process.wait()
        return self.process.returncode

    def _signal_group(self, sig: signal.Signals) -> None:
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            pass  # it exited meanwhile


def start_server(
    command: Sequence[str], port: int, log_dir: Path, env: dict[str, str] | None = None
) -> ServerProcess:
    """Start (but do not wait for) `command`, a server on `port` (see serve_command), its
    output in LOG_DIR/server-PORT.log; call wait_healthy() before using it."""
    log_path = log_dir / f"server-{port}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    return ServerProcess(process, port, log_path)


def launch_server(
    log_dir: Path, args: Sequence[str] = (), env: dict[str, str] | None = None
) -> ServerProcess:
    """`kvserve serve ARGS...` on a free port, started but not waited for."""
    port = free_port()
    return start_server(serve_command(port, args), port, log_dir, env)
