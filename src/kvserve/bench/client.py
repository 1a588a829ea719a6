"""One streamed request to an OpenAI-compatible server, timed chunk by chunk.

The clock starts just before the POST and stops when the stream ends; TTFT is the first
chunk that carries text, each later text chunk adds one ITL gap.  Token counts come from the
final usage chunk (`stream_options.include_usage`); a server that sends none gets its output
counted by `count_tokens` on the generated text.  Every failure (HTTP error, an error event,
a dropped connection, a stream without `[DONE]`) becomes a failed record with its error,
never an exception, so one bad request cannot stop the run.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvserve.bench.datasets import SampleRequest
from kvserve.bench.metrics import RequestRecord


@dataclass(frozen=True)
class RequestSpec:
    """What every request of a run shares."""

    api_url: str
    model: str
    backend: str = "openai"
    ignore_eos: bool = False
    api_key: str | None = None
    sampling: tuple[tuple[str, float | int], ...] = (("temperature", 0.0),)


def request_body(spec: RequestSpec, sample: SampleRequest) -> dict[str, Any]:
    """Streamed, with usage, greedy unless the spec's sampling says otherwise: the JSON a
    request posts."""
    body: dict[str, Any] = {
        "model": spec.model,
        "max_tokens": sample.output_len,
        **dict(spec.sampling),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if sample.messages is not None:
        body["messages"] = sample.messages
    elif spec.backend == "openai-chat":
        body["messages"] = [{"role": "user", "content": sample.prompt}]
    else:
        body["prompt"] = sample.prompt
    if spec.ignore_eos:
        body["ignore_eos"] = True
    return body


def _chunk_text(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        return (choice["delta"] or {}).get("content") or ""
    return choice.get("text") or ""


class _StreamState:
    """Folds SSE chunks into a record as they arrive."""

    def __init__(self, record: RequestRecord, start: float) -> None:
        self.record, self.start = record, start
        self.last: float | None = None
        self.texts: list[str] = []
        self.done = False

    def feed(self, payload: str, now: float) -> None:
        if payload == "[DONE]":
            self.done = True
            return
        chunk = json.loads(payload)
        if "error" in chunk:
            error = chunk["error"]
            raise _StreamError(
                error.get("message", str(error)) if isinstance(error, dict) else str(error)
            )
        if text := _chunk_text(chunk):
            if self.last is None:
                self.record.ttft = now - self.start
            else:
                self.record.itl.append(now - self.last)
            self.last = now
            self.texts.append(text)
        if usage := chunk.get("usage"):
            self.record.input_len = usage.get("prompt_tokens", self.record.input_len)
            self.record.output_len = usage.get("completion_tokens", 0)
            details = usage.get("prompt_tokens_details") or {}
            self.record.cached_tokens = details.get("cached_tokens") or 0


class _StreamError(Exception):
    """An error event inside a 200 stream."""


async def send_request(
    session: aiohttp.ClientSession,
    spec: RequestSpec,
    sample: SampleRequest,
    t0: float,
    count_tokens: Callable[[str], int] | None = None,
) -> RequestRecord:
    """Post one request and time its stream; t0 is the run's start (perf_counter)."""
    record = RequestRecord(
        prompt_len=sample.prompt_len,
        expected_output_len=sample.output_len,
        input_len=sample.prompt_len,
    )
    headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
    start = time.perf_counter()
    record.start_time = start - t0
    state = _StreamState(record, start)
    try:
        async with session.post(
            spec.api_url, json=request_body(spec, sample), headers=headers
        ) as response:
            if response.status != 200:
                body = (await response.text())[:300]
                record.error = f"HTTP {response.status}: {body}"
            else:
                await _read_events(response, state)
                if not state.done:
                    record.error = "the stream ended without [DONE]"
    except _StreamError as exc:
        record.error = f"error event: {exc}"
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    end = time.perf_counter()
    _finish(record, state, start, end, t0, count_tokens)
    return record


async def _read_events(response: aiohttp.ClientResponse, state: _StreamState) -> None:
    """Server-sent events: `data: ...` lines separated by blank lines (LF or CRLF).  Events
    that arrive in one network read share its timestamp."""
    buffer = b""
    async for piece in response.content.iter_any():
        now = time.perf_counter()
        buffer = (buffer + piece).replace(b"\r\n", b"\n")
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            for line in event.decode("utf-8", errors="replace").splitlines():
                if line.startswith("data:"):
                    state.feed(line[5:].strip(), now)


def _finish(
    record: RequestRecord,
    state: _StreamState,
    start: float,
    end: float,
    t0: float,
    count_tokens: Callable[[str], int] | None,
) -> None:
    record.latency = end - start
    record.end_time = end - t0
    record.generated_text = "".join(state.texts)
    record.success = not record.error
    if not record.success:
        return
    if state.last is None:  # no text at all (e.g. only EOS-like tokens): first = last event
        record.ttft = record.latency
    if record.output_len == 0 and record.generated_text:
        record.output_len = (
            count_tokens(record.generated_text) if count_tokens else len(state.texts)
        )
