"""What /v1/completions and /v1/chat/completions share: validation into SamplingParams (400s
that name the field), starting requests on the AsyncLLM, usage.

Everything is checked before the first `add_request`, so a rejected request leaves no trace in
the engine and never disturbs the others.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field

from kvserve.config import DEFAULT_RETENTION_PRIORITY, RequestLimits
from kvserve.engine.async_llm import AsyncLLM, EngineDeadError, RequestStream
from kvserve.errors import ParameterError, QueueFullError
from kvserve.request import RequestOutputKind, SamplingParams
from kvserve.server.errors import APIError
from kvserve.server.metrics import ServerMetrics
from kvserve.server.protocol import PromptTokensDetails, SamplingRequest, UsageInfo
from kvserve.server.structured_fields import structured_output_of, validate_structured
from kvserve.server.tokenization import ServerTokenizers
from kvserve.step import RequestOutput, merge_deltas

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
RETRY_AFTER_S = "1"  # seconds a client told 429 should wait: the queue drains every step


@dataclass
class ServingContext:
    """The engine front, the name it is served under, the metrics, the request limits and the
    server's own tokenizers: what handlers need."""

    async_llm: AsyncLLM
    model_name: str
    metrics: ServerMetrics
    limits: RequestLimits
    tokenizers: ServerTokenizers
    stream_stall_timeout: float = 0.0  # --stream-stall-timeout; 0: never
    tool_call_parser: str = "hermes"  # --tool-call-parser: a name in tool_parsers.PARSERS
    _token_texts: dict[int, str] = field(default_factory=dict)

    @property
    def max_model_len(self) -> int:
        return self.async_llm.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.async_llm.engine.model_config.vocab_size

    async def tokenize(self, text: str) -> list[int]:
        """The same tokenization as the engine (and offline LLM.generate) applies to text,
        on a tokenizer thread."""
        return await self.tokenizers.encode(text)

    def token_text(self, token_id: int) -> str:
        """A token's text on its own, for logprobs (cached: the vocabulary is finite)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizers.loop_tokenizer.decode([token_id])
        return text

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(
                f"model {name!r} does not exist; this server serves {self.model_name!r}", "model"
            )

    def check_token_ids(self, token_ids: list[int], field: str) -> None:
        """400 for more ids than a sequence can hold (checked first: O(1)) or an id outside
        the vocabulary (min and max run in C: a scan of max_model_len ids takes microseconds
        on the event loop)."""
        if len(token_ids) > self.max_model_len:
            raise APIError(
                f"{field} holds {len(token_ids)} token ids, more than this model's maximum "
                f"context length of {self.max_model_len} tokens",
                field,
            )
        if not token_ids:
            return
        for bad in (min(token_ids), max(token_ids)):
            if not 0 <= bad < self.vocab_size:
                raise APIError(f"{field}: token id {bad} is not in [0, {self.vocab_size})", field)

    def check_text(self, num_chars: int, field: str) -> None:
        """400 for a text longer than --max-prompt-chars, before it is tokenized."""
        try:
            self.limits.check_prompt_chars(num_chars, field)
        except ParameterError as exc:
            raise APIError(str(exc), field) from None

    def check_fits(
        self, num_prompt_tokens: int, max_tokens: int, prompt_field: str, max_tokens_field: str
    ) -> None:
        """400 unless prompt + max_tokens fits in max_model_len; names both numbers."""
        if num_prompt_tokens == 0:
            raise APIError(f"{prompt_field} must not be empty", prompt_field)
        limit = self.max_model_len
        if num_prompt_tokens >= limit:
            raise APIError(
                f"{prompt_field} has {num_prompt_tokens} tokens, but this model's maximum "
                f"context length is {limit} tokens (prompt plus output); shorten it",
                prompt_field,
            )
        if num_prompt_tokens + max_tokens > limit:
            raise APIError(
                f"{prompt_field} ({num_prompt_tokens} tokens) + {max_tokens_field} "
                f"({max_tokens}) = {num_prompt_tokens + max_tokens} tokens exceeds this "
                f"model's maximum context length of {limit} tokens; set {max_tokens_field} "
                f"to at most {limit - num_prompt_tokens}",
                max_tokens_field,
            )

    async def start(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        priority: int = 0,
        kv_retention_priority: int = DEFAULT_RETENTION_PRIORITY,
    ) -> RequestStream:
        """Add a validated request; its outputs feed the latency metrics as they are read.
        Its grammar, if any, is compiled and validated first, on a tokenizer thread."""
        if params.structured is not None:
            engine = self.async_llm.engine
            await validate_structured(params.structured, self.tokenizers, engine.structured.compile)
        tracker = self.metrics.start_request()
        try:
            return await self.async_llm.add_request(
                request_id, token_ids, params, on_output=tracker.observe, cache_salt=cache_salt,
                priority=priority, kv_retention_priority=kv_retention_priority,
            )  # fmt: skip
        except ParameterError as exc:  # what only the engine knows; validation catches the rest
            raise APIError(str(exc), exc.param) from None
        except QueueFullError as exc:
            raise APIError(str(exc), status=429, headers={"Retry-After": RETRY_AFTER_S}) from None
        except EngineDeadError as exc:
            raise APIError(str(exc), status=503) from None

    async def start_all(
        self,
        request_id: str,
        prompts: list[list[int]],
        params: SamplingParams,
        cache_salt: str | None = None,
        priority: int = 0,
        kv_retention_priority: int = DEFAULT_RETENTION_PRIORITY,
    ) -> list[RequestStream]:
        """Start one request per prompt (ids "<id>-<i>"); all or none."""
        ids = (
            [request_id]
            if len(prompts) == 1
            else [f"{request_id}-{i}" for i in range(len(prompts))]
        )
        streams: list[RequestStream] = []
        try:
            for sub_id, token_ids in zip(ids, prompts, strict=True):
                streams.append(await self.start(sub_id, token_ids, params, cache_salt, priority,
                                                kv_retention_priority))  # fmt: skip
        except BaseException:
            for stream in streams:
                stream.close()
            raise
        return streams


def sampling_params(
    request: SamplingRequest,
    max_tokens: int,
    logprobs: int | None,
    renames: dict[str, str],
    vocab_size: int,
    limits: RequestLimits,
) -> SamplingParams:
    """SamplingParams from the shared fields, checked against the vocabulary and the limits;
    ParameterError becomes a 400 naming the field as the client spelled it (`renames` maps
    SamplingParams names to request names).  top_k is capped at the vocabulary size, where it
    means "no top-k" anyway."""
    _reject_unsupported(request)
    try:  # before building the params: their validation scans the ids
        limits.check_stop_token_ids(len(request.stop_token_ids or ()))
    except ParameterError as exc:
        raise APIError(str(exc), exc.param) from None
    if request.seed is not None and not INT64_MIN <= request.seed <= INT64_MAX:
        raise APIError(f"seed must be a 64-bit integer, got {request.seed}", "seed")
    stop = [request.stop] if isinstance(request.stop, str) else request.stop or []
    try:
        params = SamplingParams(
            n=1 if request.n is None else request.n,
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            top_k=0 if request.top_k is None else min(request.top_k, vocab_size),
            min_p=0.0 if request.min_p is None else request.min_p,
            seed=request.seed,
            max_tokens=max_tokens,
            min_tokens=request.min_tokens or 0,
            stop=tuple(stop),
            stop_token_ids=tuple(request.stop_token_ids or ()),
            ignore_eos=request.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=request.skip_special_tokens,
            include_stop_str_in_output=request.include_stop_str_in_output,
            output_kind=RequestOutputKind.DELTA,  # O(output) held per request (async_llm.py)
            structured=structured_output_of(request),  # compiled later, off the event loop
        )
        params.check_against(vocab_size, limits)
    except ParameterError as exc:
        name = renames.get(exc.param, exc.param)
        raise APIError(f"{name} {exc.reason}", name) from None
    return params


def cache_salt_of(request: SamplingRequest, limits: RequestLimits) -> str | None:
    """The request's cache_salt; an empty one is a 400 (it would look like no salt), and so
    is one past --max-cache-salt-length."""
    if request.cache_salt is not None and not request.cache_salt:
        raise APIError("cache_salt must be a non-empty string (or omitted)", "cache_salt")
    if request.cache_salt is not None:
        try:
            limits.check_cache_salt(request.cache_salt)
        except ParameterError as exc:
            raise APIError(str(exc), "cache_salt") from None
    return request.cache_salt


def _reject_unsupported(request: SamplingRequest) -> None:
    """Fields the sampler does not implement are refused rather than silently ignored."""
    neutral = [
        ("frequency_penalty", request.frequency_penalty in (None, 0.0)),
        ("presence_penalty", request.presence_penalty in (None, 0.0)),
        ("repetition_penalty", request.repetition_penalty in (None, 1.0)),
        ("logit_bias", not request.logit_bias),
    ]
    for name, ok in neutral:
        if not ok:
            raise APIError(f"{name} is not supported by this server; omit it", name)


def usage_of(outputs: list[RequestOutput], completion: int | None = None) -> UsageInfo:
    """Usage of whole (merged) outputs; a stream's finals are its last deltas, so it passes
    its own count of `completion` tokens."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    if completion is None:
        completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def collect_final(stream: RequestStream) -> RequestOutput:
    """Read a stream of DELTA outputs to its end; the whole output, merged once."""
    deltas = []
    async with stream:
        async for output in stream:
            deltas.append(output)
    final = merge_deltas(deltas)
    assert final.finished
    return final


async def collect_all(streams: list[RequestStream]) -> list[RequestOutput]:
    """collect_final of every stream; when one fails (or this is cancelled), the others are
    cancelled too, which aborts their requests instead of computing them for nobody."""
    tasks = [asyncio.ensure_future(collect_final(stream)) for stream in streams]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()


@dataclass
class Handler:
    """What every endpoint handler holds: the serving context."""

    ctx: ServingContext
