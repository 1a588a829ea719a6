"""Constrained decoding's per-step cost at the embedded model's vocabulary (49,152 tokens):
compiling each constraint (cold, and again from the engine's cache), the grammar engine filling
the packed bitmask over a walk through an output it allows (rows in parallel, two threads), and
the runner masking the constrained rows' logits (runner/sampling.py apply_token_bitmask).
Timings are the min of several runs: the box may be shared.

    .venv/bin/python benchmarks/structured_mask.py [--repeats 50] [--engine llguidance]

`--engine xgrammar` measures XGrammar on the same tokenizer, constraints and walks, as vLLM's
xgrammar backend would build them (docs/decisions/structured-outputs.md compares the two).
kvserve does not depend on it: install it apart, e.g.
`pip install --target /tmp/xgr --no-deps xgrammar apache-tvm-ffi` and run with
PYTHONPATH=src:/tmp/xgr (its CPU path needs neither triton nor a GPU).
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from llguidance import LLMatcher

from kvserve.models.loader import embedded_model_path
from kvserve.request import StructuredOutput
from kvserve.runner.sampling import apply_token_bitmask
from kvserve.structured.grammar import GrammarCompiler
from kvserve.structured.manager import MASK_THREADS, StructuredOutputManager
from kvserve.tokenizer import load_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "tags"],
}
# (label, constraint, an output it allows): the matchers walk the output token by token
WALKS = [
    ("json schema", StructuredOutput(json=json.dumps(SCHEMA)),
     '{"name":"Johanna Smith","age":42,"tags":["alpha","beta","gamma"]}'),
    ("json object", StructuredOutput(json_object=True), '{"a":[1,2,{"b":"text"}],"c":null}'),
    ("regex", StructuredOutput(regex=r"[a-z]+@[a-z]+\.com"), "someone@example.com"),
    ("choice", StructuredOutput(choice=("alpha", "beta", "gamma")), "gamma"),
]  # fmt: skip
ROWS = (1, 8, 32, 64)


class LLGuidanceEngine:
    """kvserve's own path: structured/grammar.py compiles, the manager fills (LLExecutor)."""

    name = "llguidance"

    def __init__(self, hf_tokenizer: Any) -> None:
        self.manager = StructuredOutputManager(hf_tokenizer, frozenset({hf_tokenizer.eos_token_id}))
        self.vocab_size = self.manager.tokenizer.vocab_size  # builds the LLTokenizer
        self._compiler = GrammarCompiler(self.manager.tokenizer)

    def clear_cache(self) -> None:
        self._compiler = GrammarCompiler(self.manager.tokenizer)  # an empty LRU

    def start(self, so: StructuredOutput) -> LLMatcher:
        """A matcher at the constraint's start, as a new request gets one (a cached grammar's
        template, copied)."""
        return self._compiler.matcher(so)

    def matchers(self, so: StructuredOutput, rows: int) -> list[LLMatcher]:
        grammar = self._compiler.compile(so)
        return [LLMatcher(self.manager.tokenizer, grammar) for _ in range(rows)]

    def fill(self, matchers: list[LLMatcher]) -> np.ndarray:
        return self.manager.fill_bitmask(matchers)

    def consume(self, matcher: LLMatcher, token: int) -> bool:
        return matcher.consume_token(token)


class XGrammarEngine:
    """XGrammar as vLLM's xgrammar backend uses it, with kvserve's compact JSON (no whitespace
    between tokens) and the same mask threads as llguidance's executor."""

    name = "xgrammar"

    def __init__(self, hf_tokenizer: Any) -> None:
        try:
            import xgrammar
        except ImportError as exc:
            raise SystemExit(
                f"--engine xgrammar needs the xgrammar package ({exc}); kvserve does not depend "
                "on it: pip install --target /tmp/xgr --no-deps xgrammar apache-tvm-ffi, then "
                "run with PYTHONPATH=src:/tmp/xgr"
            ) from None
        self.xgr = xgrammar
        self.vocab_size = len(hf_tokenizer)
        info = xgrammar.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=self.vocab_size, stop_token_ids=[hf_tokenizer.eos_token_id]
        )
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=MASK_THREADS)
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=MASK_THREADS)

    def clear_cache(self) -> None:
        self.compiler.clear_cache()

    def compiled(self, so: StructuredOutput) -> Any:
        """The CompiledGrammar of `so` (from the compiler's cache when it is there)."""
        if so.json is not None or so.json_object:
            schema = so.json if so.json is not None else '{"type": "object"}'
            return self.compiler.compile_json_schema(
                schema, any_whitespace=False, separators=(",", ":")
            )
        if so.regex is not None:
            return self.compiler.compile_regex(so.regex)
        if so.choice is not None:  # vLLM's xgrammar backend: choices as an EBNF alternation
            return self.compiler.compile_grammar(
                "root ::= " + " | ".join(json.dumps(c) for c in so.choice)
            )
        raise ValueError(f"no walk for {so}")

    def start(self, so: StructuredOutput) -> Any:
        return self.xgr.GrammarMatcher(self.compiled(so))

    def matchers(self, so: StructuredOutput, rows: int) -> list[Any]:
        grammar = self.compiled(so)
        return [self.xgr.GrammarMatcher(grammar) for _ in range(rows)]

    def fill(self, matchers: list[Any]) -> np.ndarray:
        bitmask = np.zeros((len(matchers), (self.vocab_size + 31) // 32), dtype=np.int32)
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, 0)
        else:
            self.batch.batch_fill_next_token_bitmask(matchers, bitmask)
        return bitmask

    def consume(self, matcher: Any, token: int) -> bool:
        return matcher.accept_token(token)


ENGINES = {"llguidance": LLGuidanceEngine, "xgrammar": XGrammarEngine}


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def compile_ms(engine: Any, so: StructuredOutput, repeats: int) -> tuple[float, float]:
    """(cold, cached): a matcher at the start of `so` with the engine's grammar cache emptied
    first (the constraint compiled against the vocabulary), then with it warm."""

    def cold() -> None:
        engine.clear_cache()
        engine.start(so)

    cold_ms = best_ms(cold, max(1, repeats // 5))
    return cold_ms, best_ms(functools.partial(engine.start, so), repeats)


def walk_us(engine: Any, so: StructuredOutput, tokens: list[int], rows: int, walks: int) -> float:
    """Microseconds a step to fill `rows` rows, every state new (fresh matchers each walk,
    advanced after every fill); the fastest of `walks` walks."""
    best = float("inf")
    for _ in range(walks):
        matchers = engine.matchers(so, rows)
        elapsed = 0.0
        for token in tokens:
            start = time.perf_counter()
            engine.fill(matchers)
            elapsed += time.perf_counter() - start
            assert all(engine.consume(m, token) for m in matchers)
        best = min(best, elapsed)
    return best / len(tokens) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--engine", choices=sorted(ENGINES), default="llguidance")
    args = parser.parse_args()
    hf = load_tokenizer(embedded_model_path())
    start = time.perf_counter()
    engine = ENGINES[args.engine](hf)
    width = (engine.vocab_size + 31) // 32
    print(
        f"{engine.name}: vocab {engine.vocab_size}, mask row {width * 4} bytes, tokenizer view "
        f"{time.perf_counter() - start:.2f} s"
    )
    for label, so, text in WALKS:
        tokens = hf.encode(text, add_special_tokens=False)
        cold, cached = compile_ms(engine, so, args.repeats)
        print(f"compile {label:12s}: cold {cold:7.2f} ms  cached {cached * 1e3:7.1f} us")
        for rows in ROWS:
            # two walks at least: the first fill starts llguidance's mask threads
            us = walk_us(engine, so, tokens, rows, max(2, args.repeats // 10))
            print(
                f"fill  {label:12s} rows {rows:3d}: {us:8.1f} us a step  {us / rows:6.1f} us/row"
                f"  ({len(tokens)} steps)"
            )
    for rows, batch in ((1, 64), (8, 64), (32, 64)):
        logits = torch.randn(batch, engine.vocab_size)
        mask = np.random.default_rng(0).integers(-(2**31), 2**31, (rows, width))
        mask = mask.astype(np.int32)
        call = functools.partial(apply_token_bitmask, logits, list(range(rows)), mask)
        ms = best_ms(call, args.repeats)
        print(f"apply rows {rows:3d} of batch {batch}: {ms:7.3f} ms  {ms / rows * 1e3:6.1f} us/row")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
