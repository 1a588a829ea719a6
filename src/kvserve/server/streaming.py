"""Streaming plumbing: server-sent events, engine deltas -> per-choice events, merging
several requests' outputs, and aborting whatever a departed client left behind."""

from __future__ import annotations

import asyncio
import logging
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

logger = logging.getLogger("kvserve")
T = TypeVar("T")
SSE_DONE = "data: [DONE]\n\n"


def sse(event: BaseModel | bytes) -> str:
    """One server-sent event holding a JSON document."""
    data = event.model_dump_json() if isinstance(event, BaseModel) else event.decode()
    return f"data: {data}\n\n"


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several streams as they arrive.  A stream's next output is
    awaited only after its previous one was taken, so a slow consumer leaves the backlog
    coalesced in the streams' collectors instead of queued here."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    waiting = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    try:
        while waiting:
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                index = waiting.pop(task)
                try:
                    output = task.result()
                except StopAsyncIteration:
                    continue
                yield index, output
                waiting[asyncio.ensure_future(anext(streams[index]))] = index
    finally:
        for task in waiting:
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


class StreamStalledError(Exception):
    """The client read nothing for --stream-stall-timeout seconds."""


class SSEResponse(StreamingResponse):
    """A server-sent-events response (ending in `data: [DONE]`) that aborts its requests
    however the response ends: normally, by an error, by a client that hung up (Starlette
    cancels the body iterator, which may never have started, so its own `finally` cannot be
    relied on), or by one that stopped reading.

    A client that stops reading fills the socket's buffers, and the server's `send` then
    waits (uvicorn's flow control); while it waits the request's output is coalesced in its
    collector (async_llm.py).  A send that waits `stall_timeout` seconds ends the response:
    the request is aborted, its blocks are freed and uvicorn closes the connection."""

    def __init__(
        self,
        content: AsyncIterator[str],
        streams: list[RequestStream],
        stall_timeout: float | None = None,
    ) -> None:
        super().__init__(_ending_in_done(content), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})  # fmt: skip
        self._streams = streams
        self._stall_timeout = stall_timeout or None  # 0: never

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, self._stall_guarded(send))
        except StreamStalledError:
            ids = [s.request_id for s in self._streams]
            logger.warning(
                "aborting %s: its client read nothing for %.0f s (--stream-stall-timeout)",
                ", ".join(ids[:4]) + (" ..." if len(ids) > 4 else ""), self._stall_timeout,
            )  # fmt: skip
        finally:
            for stream in self._streams:
                stream.close()

    def _stall_guarded(self, send: Any) -> Any:
        if self._stall_timeout is None:
            return send

        async def guarded(message: Any) -> None:
            try:
                await asyncio.wait_for(send(message), self._stall_timeout)
            except TimeoutError:
                raise StreamStalledError from None

        return guarded


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
class _ChoiceState:
    """One choice's stream so far: characters sent, and tokens (with their logprobs) received
    but not sent yet because their text is still held back."""

    num_chars: int = 0
    held_token_ids: list[int] = field(default_factory=list)
    held_logprobs: list[TokenLogprobs] = field(default_factory=list)
    started: bool = False
    done: bool = False


@dataclass
class DeltaTracker:
    """Turns DELTA CompletionOutputs (what the engine sent since its previous output, possibly
    several steps' worth merged) into per-choice stream events.

    An event is due when text came or the choice finished; tokens whose text is still held back
    (an incomplete UTF-8 character, a possible stop string) wait for the next event, together
    with their logprobs, so text and logprobs stay aligned.  `num_tokens` counts every choice's
    tokens, for the usage chunk."""

    _choices: dict[int, _ChoiceState] = field(default_factory=dict)
    num_tokens: int = 0

    def delta(self, index: int, output: CompletionOutput) -> ChoiceDelta | None:
        state = self._choices.setdefault(index, _ChoiceState())
        if state.done:
            return None
        self.num_tokens += len(output.token_ids)
        state.held_token_ids.extend(output.token_ids)
        if output.logprobs is not None:
            state.held_logprobs.extend(output.logprobs)
        if not output.text and not output.finished:
            return None
        delta = ChoiceDelta(
            text=output.text,
            token_ids=state.held_token_ids,
            logprobs=None if output.logprobs is None else state.held_logprobs,
            finish_reason=output.finish_reason,
            stop_reason=output.stop_reason,
            first=not state.started,
            text_offset=state.num_chars,
        )
        state.started, state.done = True, output.finished
        state.num_chars += len(output.text)
        state.held_token_ids, state.held_logprobs = [], []
        return delta
