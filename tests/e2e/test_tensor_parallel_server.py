"""`kvserve serve --tensor-parallel-size 2` with worker processes (mp) and with Ray actors on
the session's Ray cluster (conftest.py): the openai-client smoke test; then a worker killed
during a request makes the server unhealthy and exit non-zero, naming the rank."""

from __future__ import annotations

import os
import re
import time

import httpx
import pytest
from e2e_server import ServerProcess
from smoke import openai_smoke, reference_text

TP_ARGS = ["--tensor-parallel-size", "2", "--kv-cache-memory", "16MiB", "--max-model-len", "512"]
EXIT_WITHIN_S = 10.0


@pytest.fixture(scope="module")
def mp_server(server_factory) -> ServerProcess:
    return server_factory(*TP_ARGS, "--distributed-executor-backend", "mp")


@pytest.fixture(scope="module")
def reference(mp_server) -> str:
    """Computed while the server loads."""
    return reference_text()


def test_mp_server_passes_the_smoke_test(mp_server, reference):
    mp_server.wait_healthy()
    assert "tensor parallel: 2 ranks (mp, gloo)" in mp_server.log()
    assert re.search(r"KV cache per rank .* \(rank 0: 2 KV heads, 30,720 bytes/token\)",
                     mp_server.log())  # fmt: skip
    openai_smoke(mp_server.base_url, reference)


def test_killed_worker_makes_the_server_unhealthy_and_exit_non_zero(mp_server):
    """Runs after the smoke test, on the same server (it ends it)."""
    mp_server.wait_healthy()
    pid = int(re.search(r"rank 1 pid (\d+)", mp_server.log()).group(1))
    with httpx.Client(base_url=mp_server.base_url, timeout=60) as http:
        body = {"prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True,
                "stream": True}  # fmt: skip
        with http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")  # generating
            os.kill(pid, 9)
            killed = time.monotonic()
            rest = "\n".join(lines)
        assert "the engine stopped before the request finished" in rest
        while mp_server.process.poll() is None and time.monotonic() - killed < EXIT_WITHIN_S:
            try:  # /health answers 503 from the moment the death is seen until the exit
                assert http.get("/health").status_code == 503
            except httpx.TransportError:
                pass  # already gone
            time.sleep(0.05)
    assert mp_server.process.wait(EXIT_WITHIN_S) == 1
    assert time.monotonic() - killed < EXIT_WITHIN_S
    assert f"tensor-parallel worker rank 1 died (pid {pid}, killed by signal 9)" in mp_server.log()


@pytest.mark.ray
def test_ray_server_passes_the_smoke_test(server_factory, ray_env, reference):
    server = server_factory(*TP_ARGS, "--distributed-executor-backend", "ray",
                            env=ray_env)  # fmt: skip
    server.wait_healthy()
    assert "tensor parallel: 2 ranks (ray, gloo)" in server.log()
    openai_smoke(server.base_url, reference)
    assert server.stop() == 0
