"""The openai-client smoke test shared by the tensor-parallel servers and the Ray Serve
deployment: greedy text equal to a one-rank reference, chat, streaming with usage, n=2, and a
repeated long prompt that reports cached tokens."""

from __future__ import annotations

from openai import OpenAI

from kvserve import LLM, SamplingParams

PROMPT = "The capital of France is"
MAX_TOKENS = 8
# 3 blocks of 16 tokens and more: its second request must find them in the prefix cache
LONG_PROMPT = "You are a helpful assistant who answers in one short sentence. " * 4


def reference_text() -> str:
    """Greedy text of PROMPT from one rank in this process (float32, like the servers)."""
    llm = LLM(kv_cache_memory=32 * 2**20, max_model_len=512, dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    return llm.generate([PROMPT], params)[0].outputs[0].text


def openai_smoke(base_url: str, reference: str, api_key: str = "none") -> None:
    client = OpenAI(base_url=f"{base_url}/v1", api_key=api_key, timeout=120, max_retries=0)
    model = client.models.list().data[0].id
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                    temperature=0.0)  # fmt: skip
    assert out.choices[0].text == reference
    assert out.usage.completion_tokens == MAX_TOKENS

    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Name a color."}], max_tokens=8,
        temperature=0.0,
    )  # fmt: skip
    assert chat.choices[0].message.content and chat.usage.completion_tokens <= 8

    stream = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reference
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS

    two = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, n=2,
                                    temperature=1.0, seed=7)  # fmt: skip
    assert len(two.choices) == 2 and two.usage.completion_tokens == 2 * MAX_TOKENS

    cached = [
        client.completions.create(model=model, prompt=LONG_PROMPT, max_tokens=2, temperature=0.0)
        for _ in range(2)
    ]
    assert cached[1].usage.prompt_tokens_details.cached_tokens >= 32
