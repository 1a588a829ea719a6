"""Requests that used to hurt the server, each answered with a 4xx the client receives, after
which the server serves normally: an out-of-vocabulary stop token id, an unknown chat role, a
20 MB body, fan-out and stop-string limits, a full waiting queue (429 + Retry-After), honest
cached_tokens with n > 1, tokenization off the event loop; and a step that raises fails only
its request, while repeated failures make the process exit non-zero within seconds."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
from e2e_server import ServerProcess, launch_faulty_server, scrape, wait_for_idle

HI = [{"role": "user", "content": "hi"}]
LIMIT_ARGS = ["--max-num-seqs", "4", "--max-waiting-requests", "4", "--max-prompts-per-request",
              "8", "--max-sequences-per-request", "16", "--dtype", "float32",
              "--max-prompt-chars", str(16 * 2**20)]  # a 15 MiB prompt to tokenize  # fmt: skip


@pytest.fixture(scope="module")
def server(server_factory) -> ServerProcess:
    server = server_factory(*LIMIT_ARGS)
    server.wait_healthy()
    return server


def assert_serves_normally(http: httpx.Client) -> None:
    body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4
    assert http.get("/health").status_code == 200


def assert_400(response: httpx.Response, param: str, *fragments: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == 400, error
    for fragment in fragments:
        assert fragment in error["message"], error


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_out_of_vocabulary_stop_token_id_is_a_400(http, path):
    body = {"prompt": "hi", "messages": HI, "max_tokens": 8, "min_tokens": 4,
            "stop_token_ids": [1_000_000_000]}  # fmt: skip
    assert_400(http.post(path, json=body), "stop_token_ids", "1000000000", "49152")
    assert_serves_normally(http)


def test_unknown_chat_role_is_a_400_naming_it(http):
    messages = [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "abracadabra"}]
    response = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert_400(response, "messages[1].role", "wizard", "system", "developer", "tool")
    for role in ("system", "developer", "assistant"):
        ok = [{"role": role, "content": "Be brief."}, *HI]
        response = http.post("/v1/chat/completions", json={"messages": ok, "max_tokens": 2})
        assert response.status_code == 200, response.text


def test_a_20_mb_body_gets_a_413_the_client_receives(server, http):
    """A plain HTTP/1.1 client that sends the whole body before reading must read the 413, not
    a connection reset (the server drains what it refuses)."""
    body = json.dumps({"prompt": "x" * (20 * 2**20)}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(body)}\r\n\r\n").encode()  # fmt: skip
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall(head + body)
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    status_line, _, rest = reply.partition(b"\r\n")
    assert status_line.startswith(b"HTTP/1.1 413"), reply[:300]
    assert b"max-request-body-bytes" in rest
    response = httpx.post(f"{server.base_url}/v1/completions", content=body, timeout=60)
    assert response.status_code == 413 and response.json()["error"]["code"] == 413
    assert_serves_normally(http)


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        ({"prompt": ["hi"] * 9}, "prompt", "--max-prompts-per-request"),
        ({"prompt": [[1, 2]] * 9}, "prompt", "--max-prompts-per-request"),
        ({"prompt": ["hi"] * 3, "n": 6}, "n", "--max-sequences-per-request"),
        ({"prompt": "hi", "n": 17}, "n", "--max-sequences-per-request"),
        ({"prompt": "hi", "stop": [f"s{i}" for i in range(17)]}, "stop", "--max-stop-strings"),
        ({"prompt": "hi", "stop": ["x" * 257]}, "stop", "--max-stop-string-length"),
        ({"prompt": "hi", "logprobs": 21}, "logprobs", "20"),
    ],
)
def test_fan_out_and_stop_string_limits(http, body, param, fragment):
    assert_400(http.post("/v1/completions", json={**body, "max_tokens": 1}), param, fragment)


def test_chat_limits_name_the_chat_fields(http):
    response = http.post(
        "/v1/chat/completions",
        json={"messages": HI, "logprobs": True, "top_logprobs": 21, "max_tokens": 1},
    )
    assert_400(response, "top_logprobs")
    response = http.post("/v1/chat/completions", json={"messages": HI, "n": 17})
    assert_400(response, "n", "--max-sequences-per-request")
    response = http.post("/v1/chat/completions", json={"messages": HI, "max_completion_tokens": 0})
    assert_400(response, "max_completion_tokens")


def test_a_full_waiting_queue_answers_429_with_retry_after(server, http):
    """4 sequences run (--max-num-seqs 4), 4 wait (--max-waiting-requests 4): one more is
    refused at once with 429, and served once the queue drains."""
    long = {"prompt": "Count:", "max_tokens": 300, "ignore_eos": True, "n": 4}

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
            running = asyncio.create_task(client.post("/v1/completions", json=long))
            await _until(lambda: scrape(server.base_url)["kvserve:num_requests_running"] == 4)
            waiting = asyncio.create_task(client.post("/v1/completions", json=long))
            await _until(lambda: scrape(server.base_url)["kvserve:num_requests_waiting"] == 4)
            refused = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
            assert refused.status_code == 429, refused.text
            assert refused.headers["retry-after"] == "1"
            assert "--max-waiting-requests" in refused.json()["error"]["message"]
            for task in (running, waiting):
                task.cancel()
            await asyncio.gather(running, waiting, return_exceptions=True)

    asyncio.run(scenario())
    assert wait_for_idle(server.base_url, timeout=30)["kvserve:kv_cache_usage_perc"] == 0
    assert_serves_normally(http)


async def _until(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(condition):
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.1)


@pytest.mark.parametrize("n", [2, 4])
def test_cached_tokens_count_prefix_cache_hits_only(http, n):
    """A new prompt: 0 cached tokens, whatever n (forked siblings are not hits); the same
    prompt again: its full blocks but the last token's (16-token blocks)."""
    prompt = list(range(100 + n, 100 + n + 40))  # 40 tokens: 2 full blocks, never seen
    body = {"prompt": prompt, "max_tokens": 2, "n": n, "temperature": 1.0, "seed": 1}
    first = http.post("/v1/completions", json=body).json()["usage"]
    assert first["prompt_tokens"] == 40
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    again = http.post("/v1/completions", json=body).json()["usage"]
    assert again["prompt_tokens_details"]["cached_tokens"] == 32


def test_health_answers_while_a_4_mib_prompt_is_tokenized(server):
    """Tokenizing ~4 MiB of text takes seconds; it runs on a tokenizer thread (which releases
    the GIL inside the Rust tokenizer), so the event loop keeps answering.  (15 MiB took ~17 s
    of the suite's 12 minutes; 4 MiB leaves dozens of probes.)"""
    text = "The quick brown fox jumps over the lazy dog. " * (4 * 2**20 // 45)
    result: dict[str, httpx.Response] = {}

    def post() -> None:
        result["r"] = httpx.post(f"{server.base_url}/tokenize", json={"prompt": text}, timeout=300)

    worker = threading.Thread(target=post)
    worker.start()
    latencies = []
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        time.sleep(1.0)  # the body is uploaded and parsed; tokenization is under way
        while worker.is_alive() and len(latencies) < 50:
            started = time.perf_counter()
            assert client.get("/health").status_code == 200
            latencies.append(time.perf_counter() - started)
            time.sleep(0.05)
    worker.join()
    assert result["r"].status_code == 200 and result["r"].json()["count"] > 800_000
    assert len(latencies) >= 5, "tokenization ended too soon to measure anything"
    latencies.sort()
    assert latencies[len(latencies) // 2] < 0.1, latencies  # the median: the machine is shared


# ---------------------------------------------------------------------- fault isolation
POISON = 4242


@pytest.fixture(scope="module")
def faulty(tmp_path_factory) -> ServerProcess:
    server = launch_faulty_server(tmp_path_factory.mktemp("faulty"), POISON)
    try:
        yield server
    finally:
        server.stop()


def test_a_failing_step_fails_its_request_and_repeated_failures_exit_non_zero(faulty):
    with httpx.Client(base_url=faulty.base_url, timeout=60) as http:
        bad = http.post("/v1/completions", json={"prompt": [1, 2, POISON], "max_tokens": 2})
        assert bad.status_code == 500, bad.text
        assert "poisoned token" in bad.json()["error"]["message"]
        stream = http.post(
            "/v1/completions", json={"prompt": [1, POISON], "max_tokens": 2, "stream": True}
        )
        assert stream.status_code == 200 and '"code":500' in stream.text
        assert stream.text.rstrip().endswith("data: [DONE]")
        assert_serves_normally(http)  # the failures were not in a row: the counter reset
        assert scrape(faulty.base_url)["kvserve:kv_cache_usage_perc"] == 0
        started = time.monotonic()
        for _ in range(3):  # three failed steps in a row: the engine gives up
            try:
                http.post("/v1/completions", json={"prompt": [POISON], "max_tokens": 2})
            except httpx.TransportError:
                break
    code = faulty.process.wait(timeout=30)
    assert code != 0 and time.monotonic() - started < 30
    log = faulty.log()
    assert "3 engine steps failed in a row" in log and "exiting with status 1" in log
