"""kvserve on Ray Serve (`serve run kvserve.ray_serve:build_app`), 2 replicas behind the
prefix-aware router, on the session's Ray cluster (conftest.py), behind an API key: the
openai-client smoke test, requests sharing a prefix (text or token ids) land on one replica,
which reports their cached tokens, and a request without the key gets 401."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
from ray_cluster import ray_bin, stop_session
from smoke import openai_smoke, reference_text

from kvserve.bench.launcher import ServerProcess, free_port
from kvserve.ray_serve import REPLICA_HEADER

pytestmark = pytest.mark.ray

ENGINE_ARGS = "--dtype float32 --kv-cache-memory 32MiB --max-model-len 512"
API_KEY = "ray-serve-test-key"
AUTH = {"authorization": f"Bearer {API_KEY}"}
START_TIMEOUT_S = 180.0


@pytest.fixture(scope="module")
def serve_url(tmp_path_factory, ray_env) -> Iterator[str]:
    log_dir = tmp_path_factory.mktemp("ray-serve")
    env = {**os.environ, **ray_env}
    port = free_port()
    log = (log_dir / "serve.log").open("w")
    subprocess.run([ray_bin("serve"), "start", "--http-port", str(port)], env=env,
                   stdout=log, stderr=subprocess.STDOUT, check=True, timeout=120)  # fmt: skip
    process = subprocess.Popen(
        [ray_bin("serve"), "run", "kvserve.ray_serve:build_app", "num_replicas=2",
         f"engine_args={ENGINE_ARGS}", f"api_key={API_KEY}"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        server = ServerProcess(process, port, log_dir / "serve.log")
        server.wait_healthy(START_TIMEOUT_S)  # RuntimeError with the log if `serve run` exits
        url = server.base_url
        wait_for_replicas(env, 2)
        yield url
    finally:
        stop_session(process)
        log.close()


STATUS_SCRIPT = """
import json, ray
from ray import serve
ray.init(logging_level="ERROR")
states = serve.status().applications["default"].deployments["kvserve"].replica_states
print(json.dumps({str(k): v for k, v in states.items()}))
"""


def wait_for_replicas(env: dict[str, str], num_replicas: int) -> None:
    """Until the kvserve deployment has every replica running (the app answers as soon as one
    does; a second one still loading would get no request).  Asked through serve.status() in
    a subprocess: `serve status` needs the dashboard, which the cluster runs without."""
    deadline = time.monotonic() + START_TIMEOUT_S
    states: dict[str, int] = {}
    while time.monotonic() < deadline:
        result = subprocess.run([sys.executable, "-c", STATUS_SCRIPT], env=env,
                                capture_output=True, text=True, timeout=120)  # fmt: skip
        states = json.loads(result.stdout.strip().splitlines()[-1])
        if states.get("ReplicaState.RUNNING", states.get("RUNNING", 0)) == num_replicas:
            return
        time.sleep(2)
    raise AssertionError(f"kvserve replicas not all running: {states}")


def test_shared_prefixes_land_on_one_replica_with_cached_tokens(serve_url):
    # no common start, and long (~450 characters): the router finds no match for the first
    # of "b" and sends it to the replica holding the fewest characters, not "a"'s.  "c" is a
    # token-id prompt (96 shared tokens), which the router once divided by zero on.
    prefixes: dict[str, str | list[int]] = {
        "a": "Pirate mode. Answer every question as a pirate would, with a parrot. " * 6,
        "b": "Librarians cite the shelf of every book they mention, always politely. " * 6,
        "c": [(t * 7919) % 40000 + 100 for t in range(96)],
    }
    seen: dict[str, list[tuple[str, int]]] = {group: [] for group in prefixes}
    with httpx.Client(base_url=serve_url, timeout=120, headers=AUTH) as http:
        for i in range(3):
            for group, prefix in prefixes.items():
                if isinstance(prefix, str):
                    prompt: str | list[int] = f"{prefix}Question {i}: what is {i} + {i}?"
                else:
                    prompt = [*prefix, 1000 + i, 2000 + i]
                response = http.post("/v1/completions", json={
                    "prompt": prompt, "max_tokens": 2, "temperature": 0.0})  # fmt: skip
                assert response.status_code == 200, response.text
                cached = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                seen[group].append((response.headers[REPLICA_HEADER], cached))
    for group, answers in seen.items():
        assert len({replica for replica, _ in answers}) == 1, (group, answers)
        assert answers[0][1] == 0 and all(cached >= 32 for _, cached in answers[1:]), answers
    assert seen["a"][0][0] != seen["b"][0][0], seen  # the two prefixes on the two replicas


def test_ray_serve_passes_the_smoke_test(serve_url):
    openai_smoke(serve_url, reference_text(), api_key=API_KEY)


def test_without_the_key_the_app_answers_401_and_health_stays_open(serve_url):
    response = httpx.post(f"{serve_url}/v1/completions", json={"prompt": "hi"}, timeout=60)
    assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{serve_url}/health", timeout=60).status_code == 200
