"""A local Ray cluster for a test module: `ray start --head --block` in a session of its own,
ended (with every process it started) by SIGINT to that session."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvserve.bench.launcher import free_port


def ray_bin(name: str) -> str:
    """A console script of the interpreter's environment (ray, serve)."""
    return str(Path(sys.executable).with_name(name))


@contextmanager
def ray_cluster(log_dir: Path, num_cpus: int) -> Iterator[str]:
    """Yields the cluster's address (for RAY_ADDRESS)."""
    port = free_port()
    log = (log_dir / "ray.log").open("w")
    process = subprocess.Popen(
        [ray_bin("ray"), "start", "--head", "--block", f"--port={port}", f"--num-cpus={num_cpus}",
         "--include-dashboard=false", "--object-store-memory=100000000", "--disable-usage-stats"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        yield f"127.0.0.1:{port}"
    finally:
        stop_session(process)
        log.close()


def stop_session(process: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGINT to the process's whole session (Ctrl+C), SIGKILL when it does not end."""
    try:
        os.killpg(process.pid, signal.SIGINT)
        process.wait(timeout)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
