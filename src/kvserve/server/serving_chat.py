"""POST /v1/chat/completions: the model's chat template, logprobs/top_logprobs, streaming,
tool calls (server/tools.py checks and templates them, server/tool_parsers.py reads them)."""

from __future__ import annotations

import json
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
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
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
from kvserve.server.streaming import (
    ChoiceDelta,
    DeltaTracker,
    SSEResponse,
    cancel_on_disconnect,
    sse,
)
from kvserve.server.tool_parsers import CallDelta, ToolStreamParser, get_parser
from kvserve.server.tools import ToolRequest, check_tools, structured_output
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
        if message.tool_calls:
            if message.role != "assistant":
                raise APIError(
                    f"messages[{i}].tool_calls: only assistant messages have tool calls",
                    f"messages[{i}].tool_calls",
                )
            item["tool_calls"] = [_call_for_template(call) for call in message.tool_calls]
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        result.append(item)
    return result


def _call_for_template(call: Any) -> dict[str, Any]:
    """As Hugging Face templates expect a call: arguments as an object where the JSON text
    is one (as vLLM passes them), else the text."""
    arguments: Any = call.function.arguments
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            arguments = parsed
    function = {"name": call.function.name, "arguments": arguments}
    result: dict[str, Any] = {"type": "function", "function": function}
    if call.id is not None:
        result["id"] = call.id
    return result


def _num_chars(dicts: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> int:
    """What --max-prompt-chars counts of a conversation: contents, calls and tools."""
    total = sum(len(d["content"]) for d in dicts)
    if tools or any("tool_calls" in d for d in dicts):
        total += sum(len(json.dumps(d.get("tool_calls", ""))) for d in dicts)
        total += len(json.dumps(tools or ""))
    return total


async def chat_token_ids(
    ctx: ServingContext,
    messages: list[ChatMessage],
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Template the conversation (and the tools) on a tokenizer thread; a template that
    rejects it is the client's 400."""
    dicts = messages_to_dicts(messages)
    ctx.check_text(_num_chars(dicts, tools), "messages")
    try:
        return await ctx.tokenizers.chat(dicts, tools)
    except Exception as exc:  # noqa: BLE001 - jinja raises for roles/orders it rejects
        reason = str(exc)[:200]
        raise APIError(f"messages: the chat template rejected them: {reason}", "messages") from None


class ChatHandler(Handler):
    async def create(self, body: ChatCompletionRequest, raw: Request) -> Response:
        ctx = self.ctx
        ctx.check_model(body.model)
        _reject_unsupported(body)
        tools = check_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
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
        forced = structured_output(tools)
        if forced is not None:
            if params.structured is not None:
                raise APIError(
                    f"tool_choice {tools.choice!r} cannot be combined with another output "
                    f"constraint ({params.structured.source})",
                    "tool_choice",
                )
            params = replace(params, structured=forced)
        token_ids = await chat_token_ids(ctx, body.messages, tools.tools)
        if max_tokens is None:  # OpenAI's default: whatever the context leaves
            max_tokens = max(1, ctx.max_model_len - len(token_ids))
            params = replace(params, max_tokens=max_tokens)
        ctx.check_fits(len(token_ids), max_tokens, "messages", max_field)
        request_id = new_id("chatcmpl")
        stream = await ctx.start(request_id, token_ids, params, cache_salt, body.priority,
                                 body.kv_retention_priority)  # fmt: skip
        if body.stream:
            events = self._stream(request_id, body, tools, params.n, stream)
            return SSEResponse(events, [stream], ctx.stream_stall_timeout)
        final = await cancel_on_disconnect(raw, collect_final(stream))
        if final is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        return JSONResponse(self._response(request_id, body, final, tools).model_dump())

    def _response(
        self,
        request_id: str,
        body: ChatCompletionRequest,
        final: RequestOutput,
        tools: ToolRequest | None = None,
    ) -> ChatCompletionResponse:
        choices = []
        for out in final.outputs:
            message = AssistantMessage(content=out.text)
            finish_reason = out.finish_reason
            if tools is not None and tools.parse:
                parsed = get_parser(self.ctx.tool_call_parser).parse(out.text)
                calls = parsed.calls if tools.parallel else parsed.calls[:1]
                if calls:
                    message = AssistantMessage(
                        content=parsed.content,
                        tool_calls=[
                            ToolCall(
                                id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)
                            )
                            for c in calls
                        ],
                    )
                    finish_reason = _finish_reason(finish_reason, tools)
            logprobs = None
            if body.logprobs and out.logprobs is not None:
                logprobs = self._logprobs(out.logprobs[: len(out.token_ids)])
            choices.append(
                ChatChoice(
                    index=out.index,
                    message=message,
                    logprobs=logprobs,
                    finish_reason=finish_reason,
                    stop_reason=out.stop_reason,
                )
            )
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
        self,
        request_id: str,
        body: ChatCompletionRequest,
        tools: ToolRequest,
        n: int,
        stream: RequestStream,
    ) -> AsyncIterator[str]:
        role = [ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                for i in range(n)]  # fmt: skip
        yield sse(self._chunk(request_id, role))
        tracker = DeltaTracker()
        parsers: dict[int, ToolStreamParser] = {}
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
                if tools.parse:
                    if out.index not in parsers:
                        parsers[out.index] = get_parser(self.ctx.tool_call_parser).stream()
                    for choice in _tool_choices(
                        out.index, delta, logprobs, parsers[out.index], tools
                    ):
                        yield sse(self._chunk(request_id, [choice]))
                    continue
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


def _finish_reason(reason: str | None, tools: ToolRequest) -> str | None:
    """`tool_calls` for an output that ended calling tools (as OpenAI and vLLM answer; a
    named tool_choice ends in "stop", as OpenAI's does); "length" stays."""
    if reason == "stop" and tools.choice != "named":
        return "tool_calls"
    return reason


def _tool_choices(
    index: int,
    delta: ChoiceDelta,
    logprobs: ChatLogprobs | None,
    parser: ToolStreamParser,
    tools: ToolRequest,
) -> list[ChatStreamChoice]:
    """One choice's delta through its tool parser: content and call fragments, one chunk
    each (the delta's logprobs with the first), the finish reason on the last."""
    items = parser.feed(delta.text)
    if delta.finish_reason is not None:
        items += parser.finish()
    messages = []
    for item in items:
        if isinstance(item, str):
            messages.append(DeltaMessage(content=item))
        elif item.index == 0 or tools.parallel:
            messages.append(DeltaMessage(tool_calls=[_delta_call(item)]))
    if not messages and (delta.finish_reason is not None or logprobs is not None):
        messages.append(DeltaMessage())
    choices = [ChatStreamChoice(index=index, delta=m) for m in messages]
    if choices:
        choices[0].logprobs = logprobs
        if delta.finish_reason is not None:
            reason = delta.finish_reason
            if parser.num_calls:
                reason = _finish_reason(reason, tools)
            choices[-1].finish_reason = reason
            choices[-1].stop_reason = delta.stop_reason
    return choices


def _delta_call(item: CallDelta) -> DeltaToolCall:
    function = DeltaFunctionCall(name=item.name, arguments=item.arguments)
    kind = "function" if item.id is not None else None
    return DeltaToolCall(index=item.index, id=item.id, type=kind, function=function)


def _reject_unsupported(body: ChatCompletionRequest) -> None:
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError("top_logprobs requires logprobs to be true", "top_logprobs")
