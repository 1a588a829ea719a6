"""`kvserve serve` in a subprocess on a free port, for the benchmark scripts: started on
entry, healthy before use, always stopped on exit (SIGTERM, then SIGKILL)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

import httpx

START_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def pinned(command: list[str], cpus: str | None) -> list[str]:
    """Prefix `taskset -c CPUS` (kvserve sizes its torch threads to the CPUs it may use)."""
    if not cpus:
        return command
    if shutil.which("taskset") is None:
        raise RuntimeError("--cpus needs taskset (util-linux)")
    return ["taskset", "-c", cpus, *command]


class KVServer:
    """The embedded model in float32 (the baseline's dtype); extra flags from the caller."""

    def __init__(self, args: list[str], log_dir: Path, cpus: str | None = None) -> None:
        self.port = free_port()
        self.log_path = log_dir / f"server-{self.port}.log"
        self.command = pinned(
            [
                sys.executable,
                "-m",
                "kvserve.cli",
                "serve",
                "--port",
                str(self.port),
                "--dtype",
                "float32",
                "--disable-uvicorn-access-log",
                *args,
            ],
            cpus,
        )
        self.process: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> KVServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        print("$ " + " ".join(self.command), flush=True)
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self, kind: type | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _wait_healthy(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"kvserve exited:\n{self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"kvserve not healthy after {START_TIMEOUT_S:.0f} s")

    def cpu_seconds(self) -> float:
        """User + system CPU time of the server process, all threads (Linux /proc)."""
        assert self.process is not None
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of stat(5)
        return (utime + stime) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
