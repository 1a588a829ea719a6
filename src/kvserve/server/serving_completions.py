"""POST /v1/completions: text or token-id prompts (one or many), echo, logprobs, streaming.

A request with several prompts becomes one engine request per prompt; choice i of prompt p
has index ``p * n + i``, as OpenAI numbers them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvserve.engine.async_llm import RequestStream
from kvserve.request import SamplingParams
from kvserve.server.errors import APIError
from kvserve.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from kvserve.server.serving import (
    Handler,
    cache_salt_of,
    collect_all,
    new_id,
    sampling_params,
    usage_of,
)
from kvserve.server.streaming import (
    DeltaTracker,
    SSEResponse,
    cancel_on_disconnect,
    merged,
    sse,
)
from kvserve.step import RequestOutput, TokenLogprobs

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


@dataclass(frozen=True)
class _Prompt:
    text: str | None  # a token-id prompt's decoded text only when echo asks for it
    token_ids: list[int]


class CompletionsHandler(Handler):
    async def create(self, body: CompletionRequest, raw: Request) -> Response:
        ctx = self.ctx
        ctx.check_model(body.model)
        _reject_unsupported(body)
        max_tokens = DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        params = sampling_params(body, max_tokens, body.logprobs, {}, ctx.vocab_size, ctx.limits)
        ctx.limits.check_fanout(len(_prompt_list(body.prompt)), params.n)  # before any tokenizing
        cache_salt = cache_salt_of(body, ctx.limits)
        prompts = await self._prompts(body)
        for prompt in prompts:
            ctx.check_fits(len(prompt.token_ids), max_tokens, "prompt", "max_tokens")
        request_id = new_id("cmpl")
        streams = await ctx.start_all(
            request_id, [p.token_ids for p in prompts], params, cache_salt, body.priority,
            body.kv_retention_priority,
        )  # fmt: skip
        if body.stream:
            events = self._stream(request_id, body, prompts, params, streams)
            return SSEResponse(events, streams, ctx.stream_stall_timeout)
        finals = await cancel_on_disconnect(raw, collect_all(streams))
        if finals is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        return JSONResponse(self._response(request_id, body, prompts, finals).model_dump())

    async def _prompts(self, body: CompletionRequest) -> list[_Prompt]:
        """Normalize the four prompt shapes; 400 for an empty one or a bad token id.  Text is
        tokenized off the event loop; echo of a token-id prompt is decoded there too."""
        prompts = []
        for item in _prompt_list(body.prompt):
            if isinstance(item, str):
                self.ctx.check_text(len(item), "prompt")
                prompts.append(_Prompt(item, await self.ctx.tokenize(item) if item else []))
            else:
                self.ctx.check_token_ids(item, "prompt")
                text = await self.ctx.tokenizers.decode(item) if body.echo else None
                prompts.append(_Prompt(text, list(item)))
        return prompts

    # ------------------------------------------------------------------ whole response
    def _response(
        self,
        request_id: str,
        body: CompletionRequest,
        prompts: list[_Prompt],
        finals: list[RequestOutput],
    ) -> CompletionResponse:
        choices = []
        for p_index, (prompt, final) in enumerate(zip(prompts, finals, strict=True)):
            prefix = self._echo_text(prompt) if body.echo else ""
            for out in final.outputs:
                logprobs = None
                if body.logprobs is not None and out.logprobs is not None:
                    num_tokens = len(out.token_ids)
                    logprobs = self._logprobs(out.logprobs[:num_tokens], len(prefix))
                choices.append(
                    CompletionChoice(
                        index=p_index * len(final.outputs) + out.index,
                        text=prefix + out.text,
                        logprobs=logprobs,
                        finish_reason=out.finish_reason,
                        stop_reason=out.stop_reason,
                    )
                )
        return CompletionResponse(
            id=request_id, model=self.ctx.model_name, choices=choices, usage=usage_of(finals)
        )

    @staticmethod
    def _echo_text(prompt: _Prompt) -> str:
        return prompt.text or ""

    def _logprobs(self, entries: list[TokenLogprobs], text_offset: int) -> CompletionLogprobs:
        """OpenAI's legacy shape; `top_logprobs` also holds the sampled token, as vLLM's."""
        result = CompletionLogprobs()
        offset = text_offset
        for entry in entries:
            token = self.ctx.token_text(entry.token_id)
            top = {self.ctx.token_text(t): lp for t, lp in entry.top}
            top.setdefault(token, entry.logprob)
            result.tokens.append(token)
            result.token_logprobs.append(entry.logprob)
            result.top_logprobs.append(top)
            result.text_offset.append(offset)
            offset += len(token)
        return result

    # ------------------------------------------------------------------ streaming
    async def _stream(
        self,
        request_id: str,
        body: CompletionRequest,
        prompts: list[_Prompt],
        params: SamplingParams,
        streams: list[RequestStream],
    ) -> AsyncIterator[str]:
        tracker = DeltaTracker()
        finals: dict[int, RequestOutput] = {}
        async for p_index, output in merged(streams):
            if output.finished:
                finals[p_index] = output
            for out in output.outputs:
                index = p_index * params.n + out.index
                delta = tracker.delta(index, out)
                if delta is None:
                    continue
                prefix = self._echo_text(prompts[p_index]) if body.echo and delta.first else ""
                logprobs = None
                if body.logprobs is not None and delta.logprobs is not None:
                    offset = delta.text_offset + len(prefix)
                    logprobs = self._logprobs(delta.logprobs, offset)
                choice = CompletionChoice(
                    index=index,
                    text=prefix + delta.text,
                    logprobs=logprobs,
                    finish_reason=delta.finish_reason,
                    stop_reason=delta.stop_reason,
                )
                yield sse(self._chunk(request_id, [choice]))
        if body.stream_options is not None and body.stream_options.include_usage:
            usage = usage_of([finals[i] for i in sorted(finals)], tracker.num_tokens)
            yield sse(self._chunk(request_id, []).model_copy(update={"usage": usage}))

    def _chunk(self, request_id: str, choices: list[CompletionChoice]) -> CompletionResponse:
        return CompletionResponse(id=request_id, model=self.ctx.model_name, choices=choices)


def _prompt_list(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """The four prompt shapes as a list of prompts; 400 for an empty list."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]  # type: ignore[list-item]
    if not prompt:
        raise APIError("prompt must not be empty", "prompt")
    return prompt  # type: ignore[return-value]


def _reject_unsupported(body: CompletionRequest) -> None:
    if body.echo and body.logprobs is not None:
        raise APIError(
            "echo with logprobs needs prompt logprobs, which this server does not compute; "
            "use one or the other",
            "echo",
        )
    if body.suffix:
        raise APIError("suffix is not supported by this server; omit it", "suffix")
    if body.best_of is not None and body.best_of != (body.n or 1):
        raise APIError("best_of is not supported by this server; use n", "best_of")
