"""Request, its status, and the user-facing sampling knobs (validated at construction)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kvserve.config import DEFAULT_RETENTION_PRIORITY, MAX_RETENTION_PRIORITY, RequestLimits
from kvserve.errors import ParameterError
from kvserve.kv.block_hasher import BlockHasher, BlockHashes

MAX_N = 128  # OpenAI's cap on `n`


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a request holds (vLLM's names).

    CUMULATIVE: everything so far (simple; each output costs O(output length)).
    DELTA: only what is new since the previous output, so a server that coalesces unread
    outputs holds O(output) per request whatever the client's read rate.
    FINAL_ONLY: one output, when the request finishes (offline generation)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on a request's output (vLLM's `StructuredOutputsParams`): exactly one of
    the fields is set.  The engine compiles it into a grammar (kvserve/structured/) and masks
    each sampled row's logits to the tokens the grammar allows next."""

    json: str | None = None  # a JSON schema, serialized; "{}" or any object schema
    json_object: bool = False  # any JSON object (response_format json_object)
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None  # Lark (llguidance's dialect) or GBNF
    # The request field it came from, named in errors ("response_format", "structured_outputs")
    source: str = "structured_outputs"


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters, named as in vLLM.  ValueError names the bad field."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top logprobs per generated token (the sampled one always)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured: StructuredOutput | None = None  # constrained decoding (kvserve/structured/)
    # stop_token_ids as a set, built once: the stop check and the min_tokens mask read it
    # every token, and a request may carry --max-stop-token-ids of them
    stop_token_id_set: frozenset[int] = field(
        default=frozenset(), init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self._validate()
        object.__setattr__(self, "stop_token_id_set", frozenset(self.stop_token_ids))

    def _validate(self) -> None:
        checks = [
            ("n", 1 <= self.n <= MAX_N, f"must be between 1 and {MAX_N}"),
            ("temperature", 0.0 <= self.temperature <= 100.0, "must be between 0 and 100"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", self.top_k >= -1, "must be -1, 0 (disabled) or positive"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1, "must be >= 1"),
            ("min_tokens", self.min_tokens >= 0, "must be >= 0"),
            (
                "min_tokens",
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                "must be <= max_tokens",
            ),
            (
                "logprobs",
                self.logprobs is None or self.logprobs >= 0,
                "must be >= 0 (the cap is --max-logprobs)",
            ),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings"),
            (
                "stop_token_ids",
                all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
                "must be integers >= 0",
            ),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ParameterError(name, f"{why}, got {_short_repr(getattr(self, name))}")

    def check_against(self, vocab_size: int, limits: RequestLimits) -> None:
        """What only the serving engine knows: the vocabulary and its configured limits.
        ParameterError names the field; called before a request reaches the engine thread."""
        limits.check_stop_token_ids(len(self.stop_token_ids))
        if self.stop_token_ids and max(self.stop_token_ids) >= vocab_size:
            bad = max(self.stop_token_ids)
            raise ParameterError("stop_token_ids", f"must be in [0, {vocab_size}), got {bad}")
        limits.check_stop(self.stop)
        cap = min(limits.max_logprobs, vocab_size)  # top-k over the vocabulary at most
        if self.logprobs is not None and self.logprobs > cap:
            raise ParameterError(
                "logprobs", f"must be at most {cap} (--max-logprobs), got {self.logprobs}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


def _short_repr(value: object, limit: int = 80) -> str:
    """repr for an error message, cut short: a huge value must not make a huge response."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self.name.startswith("FINISHED")

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.finished else None


@dataclass(eq=False)
class Request:
    """One sequence as the scheduler sees it.  Only the scheduler mutates it.

    token layout:  [ prompt_token_ids | output_token_ids ]
                   [ computed ....................| to compute ]
                                   num_computed_tokens ^
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens taken from the prefix cache; -1 until admitted
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    fork_of: str | None = None  # a sibling whose prompt blocks this request will share
    cache_salt: str | None = None  # its blocks are shared only with requests of this salt
    priority: int = 0  # vLLM's: lower is served first (--scheduling-policy priority)
    # 0-100: its cached blocks, once freed, are evicted after those of lower values
    kv_retention_priority: int = DEFAULT_RETENTION_PRIORITY
    # its full blocks' keys, salted: made by hash_blocks_with (the scheduler, on add_request)
    block_hashes: BlockHashes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)

    def hash_blocks_with(self, hasher: BlockHasher) -> None:
        """Start the request's block hashes: `cache_salt` is read here, once; the full blocks
        so far are hashed now, each later one when its last token is appended.  They are kept
        across preemptions (the tokens do not change) and read by the cache manager."""
        assert self.block_hashes is None, "a request's block hashes are made once"
        self.block_hashes = hasher.for_request(self.cache_salt)
        self.block_hashes.extend(self.all_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.block_hashes is not None:
            self.block_hashes.extend(self.all_token_ids)


def check_priorities(priority: int, kv_retention_priority: int) -> None:
    """ParameterError naming `priority` or `kv_retention_priority` when out of range."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ParameterError("priority", f"must be an integer, got {_short_repr(priority)}")
    if not 0 <= kv_retention_priority <= MAX_RETENTION_PRIORITY:
        raise ParameterError(
            "kv_retention_priority",
            f"must be in [0, {MAX_RETENTION_PRIORITY}], got {_short_repr(kv_retention_priority)}",
        )
