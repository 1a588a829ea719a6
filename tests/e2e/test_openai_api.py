"""The server through the official `openai` client: completions and chat, streaming or not,
n, stop, logprobs, echo, seeds, usage; greedy text equal to offline `LLM.generate`; 32
concurrent streams; a client that disconnects mid-stream frees its blocks at once."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

import httpx
import pytest
from e2e_server import ServerProcess, scrape, wait_for_idle
from openai import AsyncOpenAI

from kvserve import LLM, SamplingParams
from kvserve.step import RequestOutput
from kvserve.tokenizer import apply_chat_template

PROMPT = "The capital of France is"
OTHER_PROMPT = "One, two, three,"
CHAT = [{"role": "user", "content": "Name three colors."}]
CONCURRENT_PROMPTS = [f"Count from {i}: {i}, {i + 1}," for i in range(32)]
MAX_TOKENS = 8  # every greedy comparison uses this, so one offline batch gives all references


@dataclass
class Reference:
    """Offline greedy outputs (kvserve.LLM in this process) of every prompt the tests use."""

    outputs: dict[str, RequestOutput]  # prompt text, or "chat" -> output

    def text(self, key: str) -> str:
        return self.outputs[key].outputs[0].text


def offline_reference() -> Reference:
    llm = LLM(kv_cache_memory=128 * 2**20, max_model_len=2048, dtype="float32")  # as the server
    chat_ids = apply_chat_template(llm.get_tokenizer(), CHAT)
    keys = [PROMPT, OTHER_PROMPT, *CONCURRENT_PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outputs = llm.generate([*keys, chat_ids], params)  # type: ignore[list-item]
    return Reference(dict(zip([*keys, "chat"], outputs, strict=True)))


@pytest.fixture(scope="module")
def started(server_factory) -> tuple[ServerProcess, Reference]:
    """The server loads while this process computes the offline reference."""
    server = server_factory()
    reference = offline_reference()
    server.wait_healthy()
    return server, reference


@pytest.fixture(scope="module")
def server(started) -> ServerProcess:
    return started[0]


@pytest.fixture(scope="module")
def reference(started) -> Reference:
    return started[1]


def test_models_lists_the_served_model(client, model):
    models = client.models.list().data
    assert [m.id for m in models] == [model] == ["SmolLM2-135M-Instruct"]


def test_greedy_completion_equals_offline_generate(client, model, reference):
    expected = reference.outputs[PROMPT]
    result = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0
    )
    assert result.choices[0].text == expected.outputs[0].text
    assert result.choices[0].finish_reason == expected.outputs[0].finish_reason
    assert result.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert result.usage.completion_tokens == len(expected.outputs[0].token_ids)
    assert result.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens


def test_greedy_chat_equals_offline_chat(client, model, reference):
    expected = reference.outputs["chat"]
    result = client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0
    )
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].message.content == expected.outputs[0].text
    assert result.usage.prompt_tokens == len(expected.prompt_token_ids)


def test_streamed_completion_with_usage(client, model, reference):
    expected = reference.outputs[PROMPT].outputs[0]
    stream = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) > 1  # really streamed
    assert "".join(c.choices[0].text for c in text_chunks) == expected.text
    assert text_chunks[-1].choices[0].finish_reason == expected.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)
    # 5 prompt tokens: shorter than one block, so never a cache hit however often it is sent
    # (tests/e2e/test_hardening.py checks counts that are not 0).
    assert chunks[-1].usage.prompt_tokens == 5
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 0


def test_streamed_chat_with_usage(client, model, reference):
    expected = reference.outputs["chat"]
    stream = client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == expected.outputs[0].text
    assert chunks[-1].usage.completion_tokens == len(expected.outputs[0].token_ids)


def test_n2_and_seed_reproducibility(client, model):
    def sample(seed: int):
        return client.completions.create(
            model=model, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=seed, n=2,
            extra_body={"ignore_eos": True},
        )  # fmt: skip

    first, second = sample(1234), sample(1234)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert first.usage.completion_tokens == 16


def test_chat_seed_reproducibility(client, model):
    def sample() -> str:
        result = client.chat.completions.create(
            model=model, messages=CHAT, max_tokens=8, temperature=1.0, seed=7
        )
        return result.choices[0].message.content

    assert sample() == sample()


def test_stop_string_ends_the_text(client, model, reference):
    full = reference.text(PROMPT)
    stop = full.strip()[2:4]  # something the greedy text surely contains
    result = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stop=[stop]
    )
    assert result.choices[0].text == full[: full.index(stop)]
    assert result.choices[0].finish_reason == "stop"


def test_completion_logprobs(client, model):
    result = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2
    )
    logprobs = result.choices[0].logprobs
    assert len(logprobs.tokens) == result.usage.completion_tokens == 6
    assert "".join(logprobs.tokens) == result.choices[0].text
    assert logprobs.text_offset[0] == 0
    rows = zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True)
    for token, value, top in rows:
        assert value <= 0 and 2 <= len(top) <= 3
        assert math.isclose(value, max(top.values()), abs_tol=1e-5)  # greedy took the best
        assert top[token] == value


def test_chat_logprobs(client, model):
    result = client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = result.choices[0].logprobs.content
    assert len(content) == result.usage.completion_tokens
    assert "".join(item.token for item in content) == result.choices[0].message.content
    for item in content:
        assert len(item.top_logprobs) == 3
        assert math.isclose(item.logprob, item.top_logprobs[0].logprob, abs_tol=1e-5)


def test_echo(client, model, reference):
    echoed = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, echo=True
    )
    assert echoed.choices[0].text == PROMPT + reference.text(PROMPT)


def test_several_token_id_prompts_in_one_request(client, model, reference):
    prompts = [reference.outputs[p].prompt_token_ids for p in (PROMPT, OTHER_PROMPT)]
    result = client.completions.create(
        model=model, prompt=prompts, max_tokens=MAX_TOKENS, temperature=0
    )
    by_index = {c.index: c.text for c in result.choices}
    assert by_index == {0: reference.text(PROMPT), 1: reference.text(OTHER_PROMPT)}


def test_32_concurrent_streams_are_independent(server, model, reference):
    prompts = CONCURRENT_PROMPTS
    expected = [reference.text(p) for p in prompts]
    assert len(set(expected)) > 16  # distinct outputs, so a mix-up would show

    async def run_all() -> list[str]:
        async with AsyncOpenAI(
            base_url=f"{server.base_url}/v1", api_key="none", timeout=120, max_retries=0
        ) as client:

            async def one(prompt: str) -> str:
                stream = await client.completions.create(
                    model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True
                )
                return "".join([c.choices[0].text async for c in stream if c.choices])

            return await asyncio.gather(*(one(p) for p in prompts))

    before = scrape(server.base_url)["kvserve:time_to_first_token_seconds_count"]
    assert asyncio.run(run_all()) == expected
    after = wait_for_idle(server.base_url)
    assert after["kvserve:time_to_first_token_seconds_count"] - before == 32
    assert after["kvserve:num_requests_running"] == 0
    assert after["kvserve:kv_cache_usage_perc"] == 0


def test_disconnect_mid_stream_frees_blocks(server, model):
    baseline = wait_for_idle(server.base_url)
    body = {
        "model": model, "prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True,
        "temperature": 0, "stream": True,
    }  # fmt: skip
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{server.base_url}/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()  # leaving this iterator would close the connection
            events = [line for _, line in zip(range(6), lines, strict=False) if line]
            assert len(events) == 3 and all(e.startswith("data: {") for e in events)
            during = scrape(server.base_url)
        # leaving the block closes the connection mid-stream
    assert during["kvserve:num_requests_running"] == 1
    assert during["kvserve:kv_cache_usage_perc"] > baseline["kvserve:kv_cache_usage_perc"]
    after = wait_for_idle(server.base_url, timeout=5)
    assert after["kvserve:num_requests_running"] == 0
    assert after["kvserve:kv_cache_usage_perc"] == baseline["kvserve:kv_cache_usage_perc"]
    assert (
        after["kvserve:generation_tokens_total"] < baseline["kvserve:generation_tokens_total"] + 100
    )


def test_disconnect_of_a_non_streaming_request_aborts_it(server, model):
    body = {"model": model, "prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True}
    before = wait_for_idle(server.base_url)["kvserve:generation_tokens_total"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=1.5)
    after = wait_for_idle(server.base_url, timeout=5)
    assert after["kvserve:num_requests_running"] == 0
    assert after["kvserve:kv_cache_usage_perc"] == 0
    assert after["kvserve:generation_tokens_total"] - before < 100


def test_tokenize_detokenize(server, model, reference):
    token_ids = reference.outputs[PROMPT].prompt_token_ids
    tokens = httpx.post(f"{server.base_url}/tokenize", json={"model": model, "prompt": PROMPT})
    assert tokens.status_code == 200
    assert tokens.json()["tokens"] == token_ids and tokens.json()["count"] == len(token_ids)
    assert tokens.json()["max_model_len"] == 2048
    text = httpx.post(f"{server.base_url}/detokenize", json={"tokens": token_ids})
    assert text.json() == {"prompt": PROMPT}


def test_metrics_exposes_the_vllm_names(server):
    names = scrape(server.base_url)
    for name in (
        "kvserve:kv_cache_usage_perc", "kvserve:num_requests_running",
        "kvserve:num_requests_waiting", "kvserve:num_preemptions_total",
        "kvserve:prefix_cache_queries_total", "kvserve:prefix_cache_hits_total",
        "kvserve:prompt_tokens_total", "kvserve:generation_tokens_total",
        "kvserve:time_to_first_token_seconds_count", "kvserve:inter_token_latency_seconds_count",
        "kvserve:e2e_request_latency_seconds_count",
    ):  # fmt: skip
        assert name in names, name
    assert names["kvserve:prompt_tokens_total"] > 0
    assert names["kvserve:prefix_cache_queries_total"] >= names["kvserve:prefix_cache_hits_total"]


def test_server_log_is_readable_and_clean(server):
    log = server.log()
    assert "KV cache:" in log and "max concurrency" in log
    assert f"http://127.0.0.1:{server.port}/v1" in log
    assert "Avg generation throughput" in log  # the periodic status line
    assert "Traceback" not in log
