"""`kvserve serve` in a subprocess on a free port, for the benchmark scripts: started on
entry, healthy before use, always stopped on exit (SIGTERM, then SIGKILL).

The launching itself is kvserve.bench.launcher's (shared with the end-to-end tests); this adds
what only the benchmarks need: float32, CPU pinning with taskset, and the server's CPU time."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import TracebackType

from kvserve.bench.launcher import ServerProcess, free_port, serve_command, start_server

START_TIMEOUT_S = 300.0


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
        self.log_dir = log_dir
        flags = ["--dtype", "float32", "--disable-uvicorn-access-log", *args]
        self.command = pinned(serve_command(self.port, flags), cpus)
        self.server: ServerProcess | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> KVServer:
        print("$ " + " ".join(self.command), flush=True)
        self.server = start_server(self.command, self.port, self.log_dir)
        try:
            self.server.wait_healthy(START_TIMEOUT_S)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self, kind: type | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def cpu_seconds(self) -> float:
        """User + system CPU time of the server process, all threads (Linux /proc)."""
        assert self.server is not None
        stat = Path(f"/proc/{self.server.process.pid}/stat").read_text()
        fields = stat.rsplit(")", 1)[1].split()
        utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of stat(5)
        return (utime + stime) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
