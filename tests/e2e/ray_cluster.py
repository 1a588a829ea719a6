"""A local Ray cluster for the tests: `ray start --head --block` in a session of its own, ended
(with every process it started) by SIGINT to that session.  Its /tmp/ray/ray_current_cluster
goes with it: a later `ray.init()` on this machine would try to join the stopped cluster
through that file and wait for ever."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvserve.bench.launcher import free_port


def ray_bin(name: str) -> str:
    """A console script of the interpreter's environment (ray, serve)."""
    return str(Path(sys.executable).with_name(name))


# Without a token in ~/.ray (which a `ray.init()` that starts a local cluster writes), the
# cluster and its clients agree on no authentication; with one, they would each decide alone.
NO_AUTH = {"RAY_AUTH_MODE": "disabled"}


@contextmanager
def ray_cluster(log_dir: Path, num_cpus: int) -> Iterator[dict[str, str]]:
    """Yields the variables its clients need: RAY_ADDRESS and the authentication mode."""
    port = free_port()
    log = (log_dir / "ray.log").open("w")
    process = subprocess.Popen(
        [ray_bin("ray"), "start", "--head", "--block", f"--port={port}", f"--num-cpus={num_cpus}",
         "--include-dashboard=false", "--object-store-memory=100000000", "--disable-usage-stats"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **NO_AUTH},
    )  # fmt: skip
    try:
        yield {"RAY_ADDRESS": f"127.0.0.1:{port}", **NO_AUTH}
    finally:
        stop_session(process)
        log.close()
        forget_cluster(port)


def forget_cluster(port: int) -> None:
    """Remove Ray's note of the current cluster when it names this (stopped) one."""
    note = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
    try:
        if note.read_text().strip().endswith(f":{port}"):
            note.unlink()
    except FileNotFoundError:
        pass


def stop_session(process: subprocess.Popen, timeout: float = 3.0) -> None:
    """SIGINT to the process's whole session (Ctrl+C), SIGKILL when it does not end.  Alone,
    `ray start --block` ends 1.7 s after its SIGINT; at the end of the full suite neither it
    nor `serve run` ended within 30 s (two 30 s teardowns in --durations, both then killed),
    nor within 10 s (two 10.0 s teardowns), so a longer wait only delays the same SIGKILL."""
    try:
        os.killpg(process.pid, signal.SIGINT)
        process.wait(timeout)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
