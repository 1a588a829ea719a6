"""One llguidance matcher per constrained sequence, the step's token bitmask, and the grammar's
say on when a sequence stops.

    add_request          a copy of the compiled grammar's matcher (n > 1: one per child)
    with_bitmask(step)   the scheduled rows that sample and have a matcher: their packed
                         bitmask (numpy int32 [R, ceil(vocab / 32)], filled in parallel in
                         Rust), on the SchedulerOutput; the step is unchanged without any
    advance(step, ids)   each sampled token into its matcher -> the sequences the grammar
                         ends: "stop" once the matcher is stopped (the grammar is complete,
                         EOS or not), "abort" if a token broke it (a bug: the mask forbids it)

A matcher only ever consumes tokens that were appended to its request's output, so a
preempted request, recomputed from its prompt and outputs, finds its matcher where its
output left it; `with_bitmask` still checks the count of consumed tokens against the output
and replays the output into a reset matcher when they differ.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, replace
from typing import Any

import llguidance.numpy as llg_numpy
import numpy as np
from llguidance import LLExecutor, LLMatcher, LLTokenizer

from kvserve.request import Request, RequestStatus, StructuredOutput
from kvserve.step import SchedulerOutput
from kvserve.structured.grammar import GrammarCompiler

logger = logging.getLogger("kvserve")
MASK_THREADS = 2  # llguidance's mask workers; a step's rows are filled in parallel


def make_ll_tokenizer(
    hf_tokenizer: Any, eos_token_ids: frozenset[int] = frozenset()
) -> LLTokenizer:
    """llguidance's view of a Hugging Face fast tokenizer (~0.4 s for 49,152 tokens: built
    once).  Every EOS id of the model inside the vocabulary ends a grammar."""
    backend = hf_tokenizer.backend_tokenizer  # a fast tokenizer's Rust core
    vocab = backend.get_vocab_size(with_added_tokens=True)
    eos = sorted(t for t in eos_token_ids if t < vocab)
    if not eos and hf_tokenizer.eos_token_id is not None:
        eos = [hf_tokenizer.eos_token_id]
    try:
        from llguidance.hf import from_tokenizer

        return from_tokenizer(hf_tokenizer, eos_token=eos or None)
    except ValueError:  # not a transformers PreTrainedTokenizerFast, but it has the Rust core
        copy = type(backend).from_str(backend.to_str())
        copy.no_padding()
        copy.no_truncation()
        return LLTokenizer(copy.to_str(), eos_token=eos or None)


@dataclass
class _Constrained:
    request: Request
    matcher: LLMatcher
    num_consumed: int = 0  # output tokens the matcher has consumed


class StructuredOutputManager:
    """The engine's constrained sequences.  The tokenizer view and the executor are made on
    the first constrained request: an engine that never sees one pays nothing."""

    def __init__(self, hf_tokenizer: Any, eos_token_ids: frozenset[int]) -> None:
        self._hf_tokenizer = hf_tokenizer
        self._eos_token_ids = eos_token_ids
        self._tokenizer: LLTokenizer | None = None
        self._compiler: GrammarCompiler | None = None
        self._executor: LLExecutor | None = None
        self._sequences: dict[str, _Constrained] = {}  # the engine thread's only
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> LLTokenizer:
        return self._ll_tokenizer(self._hf_tokenizer)

    def _ll_tokenizer(self, hf_tokenizer: Any) -> LLTokenizer:
        """Built once, from whichever thread asks first, with that thread's own copy of the
        HF tokenizer (a fast tokenizer must not be read by two threads at once)."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = make_ll_tokenizer(hf_tokenizer, self._eos_token_ids)
            return self._tokenizer

    def compiler(self, hf_tokenizer: Any = None) -> GrammarCompiler:
        tokenizer = self._ll_tokenizer(hf_tokenizer or self._hf_tokenizer)
        with self._lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(tokenizer)
            return self._compiler

    @property
    def mask_width(self) -> int:
        """int32 words of one row's bitmask."""
        return (self.tokenizer.vocab_size + 31) // 32

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._sequences

    def __len__(self) -> int:
        return len(self._sequences)

    def compile(self, so: StructuredOutput, hf_tokenizer: Any = None) -> str:
        """The validated grammar (cached by content); ParameterError naming the field.
        Thread-safe: the server calls it on a tokenizer thread with that thread's tokenizer,
        so that the engine thread finds the request's grammar compiled."""
        return self.compiler(hf_tokenizer).compile(so)

    def add_request(self, request: Request) -> None:
        """A matcher for `request`'s constraint (its output so far consumed), a copy of the
        compiled one, replacing one of a finished request of the same id.  ParameterError
        naming the field for an invalid constraint."""
        so = request.sampling_params.structured
        assert so is not None
        entry = _Constrained(request, self.compiler().matcher(so))
        self._replay(entry)
        self._sequences[request.request_id] = entry

    def remove(self, request_id: str) -> None:
        self._sequences.pop(request_id, None)

    def drop_finished(self) -> None:
        """Forget the matchers of finished requests (O(constrained sequences))."""
        done = [rid for rid, e in self._sequences.items() if e.request.status.finished]
        for request_id in done:
            del self._sequences[request_id]

    def _replay(self, entry: _Constrained) -> None:
        """Bring the matcher to the state of its request's output tokens."""
        outputs = entry.request.output_token_ids
        if entry.num_consumed == len(outputs):
            return
        entry.matcher.reset()
        if outputs and not entry.matcher.consume_tokens(outputs):
            logger.warning(
                "request %s: its output does not match its grammar: %s",
                entry.request.request_id, entry.matcher.get_error()[:200],
            )  # fmt: skip
        entry.num_consumed = len(outputs)

    # ----------------------------------------------------------------- one step
    def with_bitmask(self, output: SchedulerOutput) -> SchedulerOutput:
        """`output` with the bitmask of its sampled rows that have a grammar; `output` itself
        when none has."""
        if not self._sequences:
            return output
        self.drop_finished()
        rows = [
            item.request_id for item in output.scheduled
            if item.sample and item.request_id in self._sequences
        ]  # fmt: skip
        if not rows:
            return output
        entries = [self._sequences[rid] for rid in rows]
        for entry in entries:
            self._replay(entry)
        bitmask = self.fill_bitmask([e.matcher for e in entries])
        return replace(output, grammar_bitmask=bitmask, grammar_request_ids=tuple(rows))

    def fill_bitmask(self, matchers: list[LLMatcher]) -> np.ndarray:
        """[len(matchers), mask_width] int32, bit t of row i set where matchers[i] allows
        token t next (0 past the tokenizer's vocabulary)."""
        bitmask = np.zeros((len(matchers), self.mask_width), dtype=np.int32)
        if self._executor is None:
            self._executor = LLExecutor(MASK_THREADS)
        llg_numpy.fill_next_token_bitmask_par(
            self._executor, [(m, i) for i, m in enumerate(matchers)], bitmask
        )
        return bitmask

    def advance(
        self, output: SchedulerOutput, sampled_token_ids: dict[str, int]
    ) -> dict[str, RequestStatus]:
        """Each constrained row's sampled token into its matcher, for the requests still
        running; the statuses the grammar ends sequences with."""
        stops: dict[str, RequestStatus] = {}
        for request_id in output.grammar_request_ids:
            entry = self._sequences.get(request_id)
            token = sampled_token_ids.get(request_id)
            if entry is None or token is None or entry.request.status != RequestStatus.RUNNING:
                continue
            ok = entry.matcher.consume_token(token)
            entry.num_consumed += 1
            if not ok:
                logger.error(
                    "request %s: sampled token %d is not allowed by its grammar: %s",
                    request_id, token, entry.matcher.get_error()[:200],
                )  # fmt: skip
                stops[request_id] = RequestStatus.FINISHED_ABORTED
            elif entry.matcher.is_stopped():
                stops[request_id] = RequestStatus.FINISHED_STOPPED
        return stops
