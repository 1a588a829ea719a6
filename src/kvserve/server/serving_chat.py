"""POST /v1/chat/completions: the model's chat template, logprobs/top_logprobs, streaming."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvserve.engine.async_llm import RequestStream
from kvserve.server.errors import APIError
from kvserve.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    DeltaMessage,
    TopLogprob,
)
from kvserve.server.serving import (
    Handler,
    ServingContext,
    cache_salt_of,
    collect_final,
    new_id,
    sampling_params,
    usage_of,
)
from kvserve.server.streaming import DeltaTracker, SSEResponse, cancel_on_disconnect, sse
from kvserve.step import RequestOutput, TokenLogprobs

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")  # OpenAI's


def messages_to_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Plain dicts for the template; content parts are joined (text is all this model reads).
    A role OpenAI does not know is a 400 naming messages[i].role."""
    if not messages:
        raise APIError("messages must contain at least one message", "messages")
    result = []
    for i, message in enumerate(messages):
        if message.role not in CHAT_ROLES:
            raise APIError(
                f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, "
                f"got {message.role[:40]!r}",
                f"messages[{i}].role",
            )
        content = message.content
        if isinstance(content, list):
            kinds = {part.type for part in content} - {"text"}
            if kinds:
                raise APIError(
                    f"messages[{i}].content: only text parts are supported, "
                    f"got {sorted(k[:40] for k in kinds)[:5]}",
                    f"messages[{i}].content",
                )
            content = "".join(part.text or "" for part in content)
        item: dict[str, Any] = {"role": message.role, "content": content or ""}
        if message.name:
            item["name"] = message.name
        result.append(item)
    return result


async def chat_token_ids(ctx: ServingContext, messages: list[ChatMessage]) -> list[int]:
    """Template the conversation on a tokenizer thread; a template that rejects it is the
    client's 400."""
    dicts = messages_to_dicts(messages)
    ctx.check_text(sum(len(d["content"]) for d in dicts), "messages")
    try:
        return await ctx.tokenizers.chat(dicts)
    except Exception as exc:  # noqa: BLE001 - jinja raises for roles/orders it rejects
        reason = str(exc)[:200]
        raise APIError(f"messages: the chat template rejected them: {reason}", "messages") from None


class ChatHandler(Handler):
    async def create(self, body: ChatCompletionRequest, raw: Request) -> Response:
        ctx = self.ctx
        ctx.check_model(body.model)
        _reject_unsupported(body)
        max_field = "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens"
        max_tokens = (
            body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens
        )
        top = (body.top_logprobs or 0) if body.logprobs else None
        renames = {"logprobs": "top_logprobs", "max_tokens": max_field}
        # Checked before templating, with a stand-in max_tokens when none was given.
        stand_in = ctx.max_model_len if max_tokens is None else max_tokens
        params = sampling_params(body, stand_in, top, renames, ctx.vocab_size, ctx.limits)
        ctx.limits.check_fanout(1, params.n)
        cache_salt = cache_salt_of(body, ctx.limits)
        token_ids = await chat_token_ids(ctx, body.messages)
        if max_tokens is None:  # OpenAI's default: whatever the context leaves
            max_tokens = max(1, ctx.max_model_len - len(token_ids))
            params = replace(params, max_tokens=max_tokens)
        ctx.check_fits(len(token_ids), max_tokens, "messages", max_field)
        request_id = new_id("chatcmpl")
        stream = await ctx.start(request_id, token_ids, params, cache_salt)
        if body.stream:
            events = self._stream(request_id, body, params.n, stream)
            return SSEResponse(events, [stream], ctx.stream_stall_timeout)
        final = await cancel_on_disconnect(raw, collect_final(stream))
        if final is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        return JSONResponse(self._response(request_id, body, final).model_dump())

    def _response(
        self, request_id: str, body: ChatCompletionRequest, final: RequestOutput
    ) -> ChatCompletionResponse:
        choices = [
            ChatChoice(
                index=out.index,
                message=AssistantMessage(content=out.text),
                logprobs=self._logprobs(out.logprobs[: len(out.token_ids)])
                if body.logprobs and out.logprobs is not None
                else None,
                finish_reason=out.finish_reason,
                stop_reason=out.stop_reason,
            )
            for out in final.outputs
        ]
        return ChatCompletionResponse(
            id=request_id, model=self.ctx.model_name, choices=choices, usage=usage_of([final])
        )

    def _logprobs(self, entries: list[TokenLogprobs]) -> ChatLogprobs:
        content = []
        for entry in entries:
            token = self.ctx.token_text(entry.token_id)
            top = [self._top(t, lp) for t, lp in entry.top]
            content.append(
                ChatTokenLogprob(
                    token=token,
                    logprob=entry.logprob,
                    bytes=list(token.encode()),
                    top_logprobs=top,
                )
            )
        return ChatLogprobs(content=content)

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        token = self.ctx.token_text(token_id)
        return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode()))

    async def _stream(
        self, request_id: str, body: ChatCompletionRequest, n: int, stream: RequestStream
    ) -> AsyncIterator[str]:
        role = [ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                for i in range(n)]  # fmt: skip
        yield sse(self._chunk(request_id, role))
        tracker = DeltaTracker()
        final = None
        async for output in stream:
            final = output
            for out in output.outputs:
                delta = tracker.delta(out.index, out)
                if delta is None:
                    continue
                logprobs = None
                if body.logprobs and delta.logprobs is not None:
                    logprobs = self._logprobs(delta.logprobs)
                choice = ChatStreamChoice(
                    index=out.index,
                    delta=DeltaMessage(content=delta.text),
                    logprobs=logprobs,
                    finish_reason=delta.finish_reason,
                    stop_reason=delta.stop_reason,
                )
                yield sse(self._chunk(request_id, [choice]))
        options = body.stream_options
        if options is not None and options.include_usage and final is not None:
            usage = usage_of([final], tracker.num_tokens)
            yield sse(self._chunk(request_id, []).model_copy(update={"usage": usage}))

    def _chunk(self, request_id: str, choices: list[ChatStreamChoice]) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=request_id, model=self.ctx.model_name, choices=choices)


def _reject_unsupported(body: ChatCompletionRequest) -> None:
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError("top_logprobs requires logprobs to be true", "top_logprobs")
    if body.tools:
        raise APIError("tools are not supported by this server; omit them", "tools")
