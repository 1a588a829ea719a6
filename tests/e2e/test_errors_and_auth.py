"""A server started with an API key (from KVSERVE_API_KEY) and a small body limit: 401s, a 400
naming the field for each kind of bad input (while another request streams undisturbed), 413,
and SIGTERM ending in-flight requests cleanly with exit code 0."""

from __future__ import annotations

import asyncio
import json
import signal

import httpx
import openai
import pytest
from e2e_server import ServerProcess, wait_for_idle

API_KEY = "e2e-secret"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(server_factory) -> ServerProcess:
    server = server_factory("--max-request-body-bytes", "64KiB", env={"KVSERVE_API_KEY": API_KEY})
    server.wait_healthy()
    return server


@pytest.fixture(scope="module")
def http(server) -> httpx.Client:
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as client:
        yield client


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions")],
)
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"X-Api-Key": API_KEY}])
def test_v1_without_the_key_is_401(server, method, path, headers):
    body = {"prompt": "hi", "messages": HI, "max_tokens": 1}
    response = httpx.request(method, f"{server.base_url}{path}", json=body, headers=headers)
    assert response.status_code == 401
    error = response.json()["error"]
    assert error["code"] == 401 and error["type"] == "AuthenticationError" and error["message"]


def test_health_and_metrics_need_no_key(server):
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert "kvserve:kv_cache_usage_perc" in httpx.get(f"{server.base_url}/metrics").text


def test_openai_client_with_and_without_the_key(server):
    base = f"{server.base_url}/v1"
    client = openai.OpenAI(base_url=base, api_key=API_KEY, max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    result = client.completions.create(model=model, prompt="Hello", max_tokens=2, temperature=0)
    assert result.usage.completion_tokens >= 1
    wrong = openai.OpenAI(base_url=base, api_key="wrong", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


COMPLETION_ERRORS = [
    ({"model": "no-such-model", "prompt": "hi"}, "model", []),
    ({"prompt": "hi", "max_tokens": 5000}, "max_tokens", ["5000", "2048"]),
    ({"prompt": [17] * 2100, "max_tokens": 4}, "prompt", ["2100", "2048"]),
    ({"prompt": ""}, "prompt", ["empty"]),
    ({"prompt": []}, "prompt", ["empty"]),
    ({"prompt": "hi", "priority": 3}, "priority", ["--scheduling-policy priority", "fcfs"]),
    ({}, "prompt", []),
    ({"prompt": "hi", "temperature": -1}, "temperature", []),
    ({"prompt": "hi", "temperature": 1e9}, "temperature", []),
    ({"prompt": "hi", "top_p": 1.5}, "top_p", []),
    ({"prompt": "hi", "top_k": -5}, "top_k", []),
    ({"prompt": "hi", "n": 0}, "n", []),
    ({"prompt": "hi", "n": 100000}, "n", []),
    ({"prompt": "hi", "max_tokens": -1}, "max_tokens", []),
    ({"prompt": "hi", "max_tokens": "many"}, "max_tokens", []),
    ({"prompt": "hi", "min_tokens": 10, "max_tokens": 4}, "min_tokens", []),
    ({"prompt": "hi", "logprobs": 1000}, "logprobs", []),
    ({"prompt": "hi", "seed": 2**70}, "seed", []),
    ({"prompt": "hi", "stop": [""]}, "stop", []),
    ({"prompt": [1, -5]}, "prompt", ["-5"]),
    ({"prompt": [1, 10**9]}, "prompt", []),
    ({"prompt": "hi", "frequency_penalty": 0.5}, "frequency_penalty", []),
    ({"prompt": "hi", "echo": True, "logprobs": 1}, "echo", []),
    ({"prompt": "hi", "max_tokens": 5000, "stream": True}, "max_tokens", []),
]
CHAT_ERRORS = [
    ({"messages": []}, "messages", []),
    ({"messages": HI, "priority": -1}, "priority", ["--scheduling-policy priority"]),
    ({"messages": "hi"}, "messages", []),
    ({"model": "gpt-4", "messages": HI}, "model", []),
    ({"messages": HI, "max_completion_tokens": 5000}, "max_completion_tokens", ["5000"]),
    ({"messages": HI, "logprobs": True, "top_logprobs": 30}, "top_logprobs", []),
    ({"messages": HI, "top_logprobs": 2}, "top_logprobs", []),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages[0].content",
        ["text"],
    ),
]


@pytest.mark.parametrize(
    ("path", "body", "param", "fragments"),
    [("/v1/completions", *case) for case in COMPLETION_ERRORS]
    + [("/v1/chat/completions", *case) for case in CHAT_ERRORS],
)
def test_bad_input_is_a_400_naming_the_field(http, path, body, param, fragments):
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400
    assert error["param"] == param
    assert param in error["message"]
    for fragment in fragments:
        assert fragment in error["message"]


def test_malformed_json_and_non_object_bodies(http):
    for content in (b'{"prompt": "hi",', b"[1, 2]", b""):
        response = http.post("/v1/completions", content=content)
        assert response.status_code == 400, content
        assert response.json()["error"]["type"] == "BadRequestError"
    assert "JSON" in http.post("/v1/completions", content=b"{").json()["error"]["message"]


def test_body_over_the_limit_is_413(http):
    response = http.post("/v1/completions", json={"prompt": "x" * 100_000})
    assert response.status_code == 413
    assert "64" in response.text or "65536" in response.text


def test_extreme_but_valid_parameters_share_a_batch(server):
    """Edge values the sampler must take together in one batch without failing the step."""
    bodies = [
        {"top_k": 10**6}, {"top_k": 5}, {"temperature": 100.0}, {"top_p": 1e-9},
        {"min_p": 1.0}, {"seed": -(2**63)}, {"seed": 2**63 - 1, "n": 3}, {"logprobs": 20},
        {"n": 64, "max_tokens": 1}, {"stop_token_ids": [49151]}, {"min_tokens": 3},
    ]  # fmt: skip

    async def send_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.base_url, headers=AUTH, timeout=60) as http:
            return await asyncio.gather(
                *(http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, **body})
                  for body in bodies)
            )  # fmt: skip

    responses = asyncio.run(send_all())
    assert [r.status_code for r in responses] == [200] * len(bodies), [r.text for r in responses]
    assert len(responses[-3].json()["choices"]) == 64
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_bad_requests_do_not_disturb_a_running_stream(http, server):
    body = {"prompt": "Once upon a time", "max_tokens": 12, "ignore_eos": True,
            "temperature": 0, "stream": True}  # fmt: skip
    expected = http.post("/v1/completions", json={**body, "stream": False}).json()
    with http.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line)
        for bad, _, _ in COMPLETION_ERRORS:
            assert http.post("/v1/completions", json=bad).status_code == 400
        rest = [line for line in lines if line]
    events = [first, *rest]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == expected["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    idle = wait_for_idle(server.base_url)
    assert idle["kvserve:num_requests_running"] == 0
    assert idle["kvserve:num_requests_waiting"] == 0
    assert idle["kvserve:kv_cache_usage_perc"] == 0


def test_sigterm_finishes_in_flight_requests_and_exits_0(http, server):
    body = {"prompt": "Once upon a time", "max_tokens": 12, "ignore_eos": True,
            "temperature": 0, "stream": True}  # fmt: skip
    with http.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line)
        server.process.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line]
    assert first.startswith("data: {")
    assert rest[-1] == "data: [DONE]"
    last = json.loads(rest[-2].removeprefix("data: "))
    assert last["choices"][0]["finish_reason"] == "length"
    assert server.process.wait(timeout=30) == 0
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{server.base_url}/health", timeout=2)
    log = server.log()
    assert "Traceback" not in log and "kvserve serve: stopped" in log
