"""Pydantic models of the OpenAI API subset kvserve serves (plus vLLM's extra sampling fields).

Request fields are Optional where clients commonly send an explicit null; the serving code
applies the defaults.  Validation of values (ranges, lengths) happens when a request becomes
SamplingParams, so every error names the field as the client spelled it.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer

from kvserve.config import DEFAULT_RETENTION_PRIORITY


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int | None = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int | None = 0
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Accepted only at their neutral values: the sampler does not implement them.
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    repetition_penalty: float | None = 1.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's: the request's cached blocks are shared only with requests of the same salt
    # (blocks inside a --public-prefixes prefix with every request)
    cache_salt: str | None = None
    # vLLM's scheduling priority (lower is served first, with --scheduling-policy priority)
    priority: int = 0
    # 0-100 (TensorRT-LLM's retention priority): the request's cached blocks, once it ends,
    # are evicted after those of requests with a lower value (docs/prefix_cache.md)
    kv_retention_priority: int = DEFAULT_RETENTION_PRIORITY
    # Constrained decoding (server/structured_fields.py): at most one of them
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's
    guided_json: str | dict[str, Any] | None = None  # vLLM's older fields
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None


class ContentPart(BaseModel):
    type: str
    text: str | None = None


class FunctionCallIn(BaseModel):
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends a JSON string


class ToolCallIn(BaseModel):
    """A call in an earlier assistant message of the conversation."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(BaseModel):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    # Checked in server/tools.py, so that a 400 names tools[i].function.name and the like.
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None  # none | auto | required | a function
    parallel_tool_calls: bool | None = True


# ---------------------------------------------------------------------- responses
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class ChoiceEnd(BaseModel):
    """How a choice ended, in every response shape: OpenAI's reason and vLLM's stop_reason
    (the stop string or token id that matched)."""

    index: int
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ResponseHead(BaseModel):
    """The fields every completion response and chunk starts with."""

    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    usage: UsageInfo | None = None


class CompletionChoice(ChoiceEnd):
    text: str
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(ResponseHead):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class _NoneDropped(BaseModel):
    """Fields that are None are left out, as OpenAI sends stream fragments."""

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text of an object


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = ""  # None when the message is tool calls alone
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_no_calls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        if data.get("tool_calls") is None:
            data.pop("tool_calls", None)
        return data


class DeltaFunctionCall(_NoneDropped):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_NoneDropped):
    """A fragment of call `index`: the first one has id, type and name; later ones add to
    function.arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(_NoneDropped):
    """A streamed message fragment; absent fields are left out, as OpenAI sends them."""

    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChoiceEnd(ChoiceEnd):
    logprobs: ChatLogprobs | None = None


class ChatChoice(ChatChoiceEnd):
    message: AssistantMessage


class ChatStreamChoice(ChatChoiceEnd):
    delta: DeltaMessage


class ChatCompletionResponse(ResponseHead):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class ChatCompletionChunk(ResponseHead):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatStreamChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kvserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---------------------------------------------------------------------- tokenizer endpoints
class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: either `prompt` (text) or `messages` (a chat, templated)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Any] | None = None  # with messages: as /v1/chat/completions templates them
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


# ---------------------------------------------------------------------- errors
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


class PinRequest(BaseModel):
    """POST /v1/prefix_cache/pin: exactly one of prompt (text or token ids) and messages."""

    model: str | None = None
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = None
    cache_salt: str | None = None
    id: str | None = None  # chosen by the server when absent


class UnpinRequest(BaseModel):
    id: str


class PinInfo(BaseModel):
    id: str
    object: Literal["prefix_cache.pin"] = "prefix_cache.pin"
    num_tokens: int  # pinned: the prompt's full blocks
    num_blocks: int
    bytes: int  # KV cache bytes the pin holds


class PinList(BaseModel):
    object: Literal["list"] = "list"
    data: list[PinInfo]
    num_pinned_blocks: int  # distinct blocks (pins may share a prefix)
    max_pinned_blocks: int  # --max-pinned-prefix-fraction of the KV cache
