"""Streaming plumbing: server-sent events, cumulative outputs -> per-choice deltas, merging
several requests' outputs, and aborting whatever a departed client left behind."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel
from starlette.responses import StreamingResponse

from kvserve.engine.async_llm import EngineDeadError, RequestStream
from kvserve.errors import RequestFailedError
from kvserve.server.errors import error_body
from kvserve.step import CompletionOutput, RequestOutput, TokenLogprobs

T = TypeVar("T")
SSE_DONE = "data: [DONE]\n\n"


def sse(event: BaseModel | bytes) -> str:
    """One server-sent event holding a JSON document."""
    data = event.model_dump_json() if isinstance(event, BaseModel) else event.decode()
    return f"data: {data}\n\n"


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several streams as they arrive."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                queue.put_nowait((index, output))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.close()


async def _ending_in_done(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """`events`, then `data: [DONE]`; an engine failure first becomes an error event (the
    status line was sent long ago): 503 when the engine stopped, 500 when the step computing
    this request failed."""
    try:
        async for event in events:
            yield event
    except EngineDeadError as exc:
        yield sse(error_body(str(exc), 503))
    except RequestFailedError as exc:
        yield sse(error_body(str(exc), 500))
    yield SSE_DONE


class SSEResponse(StreamingResponse):
    """A server-sent-events response (ending in `data: [DONE]`) that aborts its requests
    however the response ends: normally, by an error, or by a client that hung up (Starlette
    cancels the body iterator, which may never have started, so its own `finally` cannot be
    relied on)."""

    def __init__(self, content: AsyncIterator[str], streams: list[RequestStream]) -> None:
        super().__init__(_ending_in_done(content), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})  # fmt: skip
        self._streams = streams

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for stream in self._streams:
                stream.close()


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """Run `work`, cancelling it if the client disconnects first (then None).  A non-streaming
    request whose client left is aborted instead of generating for nobody."""
    task = asyncio.ensure_future(_awaited(work))  # a Task: cancelling it retrieves `work`'s end
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():  # the client left (or this handler was cancelled): abort
            task.cancel()
    return task.result() if task.done() else None


async def _awaited(work: Awaitable[T]) -> T:
    return await work


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


@dataclass
class ChoiceDelta:
    """What one choice gained since the previous event."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None
    stop_reason: int | str | None
    first: bool  # the choice's first event (echo sends the prompt with it)
    text_offset: int  # characters of this choice sent before `text`


@dataclass
class DeltaTracker:
    """Turns cumulative CompletionOutputs into per-choice deltas.

    An event is due when text grew or the choice finished; tokens whose text is still held
    back (an incomplete UTF-8 character, a possible stop string) wait for the next event,
    together with their logprobs, so text and logprobs stay aligned."""

    _sent: dict[int, tuple[int, int]] = field(default_factory=dict)  # index -> (chars, tokens)
    _done: set[int] = field(default_factory=set)

    def delta(self, index: int, output: CompletionOutput) -> ChoiceDelta | None:
        if index in self._done:
            return None
        chars, tokens = self._sent.get(index, (0, 0))
        text = output.text[chars:]
        if not text and not output.finished:
            return None
        first = index not in self._sent
        num_tokens = len(output.token_ids)  # logprobs may run ahead while the engine appends
        self._sent[index] = (len(output.text), num_tokens)
        if output.finished:
            self._done.add(index)
        logprobs = None if output.logprobs is None else output.logprobs[tokens:num_tokens]
        return ChoiceDelta(
            text=text,
            token_ids=output.token_ids[tokens:num_tokens],
            logprobs=logprobs,
            finish_reason=output.finish_reason,
            stop_reason=output.stop_reason,
            first=first,
            text_offset=chars,
        )
