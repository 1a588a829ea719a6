"""From sampled tokens to what the caller reads: one user request's n child sequences
("<id>-<i>" for n > 1), each detokenized incrementally and cut at its stop strings, gathered
into one RequestOutput per user request touched by a step: cumulative, a delta or only the
final one, as the request's output_kind asks.

The engine owns the scheduler; this module owns the user requests' text.  A sequence stopped
by a stop string is finished through `finish_request` (the scheduler's), which frees its
blocks at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from kvserve.config import DEFAULT_RETENTION_PRIORITY
from kvserve.engine.stopping import StopStrings
from kvserve.request import Request, RequestOutputKind, RequestStatus, SamplingParams
from kvserve.step import CompletionOutput, RequestOutput, TokenLogprobs
from kvserve.tokenizer import IncrementalDetokenizer


@dataclass
class _Sequence:
    """Engine-side state of one child sequence: its text, stop strings and logprobs, and how
    much of them earlier DELTA outputs already carried."""

    detokenizer: IncrementalDetokenizer
    stop_strings: StopStrings
    logprobs: list[TokenLogprobs] | None
    stopped_by: str | None = None  # the stop string that ended the text
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent_tokens: int = 0
    num_sent_chars: int = 0

    def completion(self, index: int, kind: RequestOutputKind) -> CompletionOutput:
        """This sequence's output: everything (CUMULATIVE, FINAL_ONLY; copies, O(output)), or
        what is new since the previous call (DELTA; O(new)).  Visible text only grows (held
        back text is never shown early), so a delta is a suffix."""
        finished = self.finish_reason is not None
        token_ids = self.detokenizer.token_ids
        text = self.stop_strings.visible(self.detokenizer.text, finished)
        num_tokens, num_chars = len(token_ids), len(text)
        first_token, first_char = 0, 0
        if kind is RequestOutputKind.DELTA:
            first_token, first_char = self.num_sent_tokens, self.num_sent_chars
            self.num_sent_tokens, self.num_sent_chars = num_tokens, num_chars
        logprobs = self.logprobs
        if logprobs is not None:
            logprobs = logprobs[first_token:num_tokens]
        return CompletionOutput(
            index=index,
            text=text[first_char:],
            token_ids=token_ids[first_token:num_tokens],
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=logprobs,
        )


@dataclass
class _UserRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    child_ids: list[str]
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    sequences: dict[str, _Sequence] = field(default_factory=dict)
    num_cached_tokens: int = 0


def make_children(
    request_id: str,
    token_ids: list[int],
    params: SamplingParams,
    eos_token_ids: frozenset[int],
    arrival_time: float,
    cache_salt: str | None,
    priority: int = 0,
    kv_retention_priority: int = DEFAULT_RETENTION_PRIORITY,
) -> list[Request]:
    """The sequences of one user request: itself for n == 1, else n children `id-i`, child i
    sampling with seed + i (reproducible per sample), the later ones forks of the first."""
    child_ids = [request_id] if params.n == 1 else [f"{request_id}-{i}" for i in range(params.n)]
    return [
        Request(
            request_id=child_id,
            prompt_token_ids=token_ids,
            sampling_params=replace(
                params, n=1, seed=None if params.seed is None else params.seed + i
            ),
            eos_token_ids=eos_token_ids,
            arrival_time=arrival_time,
            fork_of=child_ids[0] if i else None,
            cache_salt=cache_salt,
            priority=priority,
            kv_retention_priority=kv_retention_priority,
        )
        for i, child_id in enumerate(child_ids)
    ]


class OutputProcessor:
    def __init__(
        self, tokenizer: object, finish_request: Callable[[str, RequestStatus], None]
    ) -> None:
        self.tokenizer = tokenizer
        self._finish_request = finish_request
        self._user_requests: dict[str, _UserRequest] = {}
        self._child_to_user: dict[str, str] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._user_requests

    def has_unfinished_requests(self) -> bool:
        return bool(self._user_requests)

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        children: list[Request],
        output_kind: RequestOutputKind,
    ) -> None:
        """Track a user request whose children the scheduler already holds."""
        child_ids = [child.request_id for child in children]
        user = _UserRequest(request_id, prompt, prompt_token_ids, child_ids, output_kind)
        for child in children:
            user.sequences[child.request_id] = self._new_sequence(child.sampling_params)
            self._child_to_user[child.request_id] = request_id
        self._user_requests[request_id] = user

    def _new_sequence(self, params: SamplingParams) -> _Sequence:
        detok = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
        stops = StopStrings(params.stop, params.include_stop_str_in_output)
        return _Sequence(detok, stops, [] if params.logprobs is not None else None)

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a user request; its child ids, for the scheduler to finish (none when it is
        not known)."""
        user = self._user_requests.pop(request_id, None)
        if user is None:
            return []
        for child_id in user.child_ids:
            self._child_to_user.pop(child_id, None)
        return user.child_ids

    def user_ids_of(self, child_ids: Iterable[str]) -> list[str]:
        """The user requests of these child ids (each once, in order; unknown ids skipped)."""
        found = {self._child_to_user[c]: None for c in child_ids if c in self._child_to_user}
        return list(found)

    def process_outputs(
        self, updated: list[Request], logprobs: dict[str, TokenLogprobs]
    ) -> list[RequestOutput]:
        """Each updated child's new token into its text; then one output per user request
        touched (none for a FINAL_ONLY request still running)."""
        touched: dict[str, None] = {}
        for request in updated:
            user_id = self._child_to_user.get(request.request_id)
            if user_id is None:
                continue
            self._process_token(request, logprobs.get(request.request_id))
            touched[user_id] = None
        outputs = (self._make_output(user_id) for user_id in touched)
        return [output for output in outputs if output is not None]

    def _process_token(self, request: Request, logprobs: TokenLogprobs | None) -> None:
        user = self._user_requests[self._child_to_user[request.request_id]]
        seq = user.sequences[request.request_id]
        num_old_chars = len(seq.detokenizer.text)
        seq.detokenizer.add(request.output_token_ids[-1:])
        cut = seq.stop_strings.cut(seq.detokenizer.text, num_old_chars)
        if cut is not None:
            seq.detokenizer.text, seq.stopped_by = cut
        if seq.logprobs is not None and logprobs is not None:
            seq.logprobs.append(logprobs)
        if user.num_cached_tokens == 0 and request.num_cached_tokens > 0:
            user.num_cached_tokens = request.num_cached_tokens
        if seq.stopped_by is not None and not request.status.finished:
            self._finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
            request.stop_reason = seq.stopped_by
        if request.status.finished:
            seq.finish_reason = request.status.finish_reason
            seq.stop_reason = request.stop_reason or seq.stopped_by

    def _make_output(self, user_id: str) -> RequestOutput | None:
        """The user request's output after this step, as its output_kind asks (None: nothing
        to send, a FINAL_ONLY request still running)."""
        user = self._user_requests[user_id]
        finished = all(user.sequences[c].finish_reason is not None for c in user.child_ids)
        if finished:
            del self._user_requests[user_id]
            for child_id in user.child_ids:
                self._child_to_user.pop(child_id, None)
        elif user.output_kind is RequestOutputKind.FINAL_ONLY:
            return None
        outputs = [
            user.sequences[child_id].completion(index, user.output_kind)
            for index, child_id in enumerate(user.child_ids)
        ]
        return RequestOutput(
            request_id=user_id,
            prompt=user.prompt,
            prompt_token_ids=user.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            num_cached_tokens=user.num_cached_tokens,
        )
