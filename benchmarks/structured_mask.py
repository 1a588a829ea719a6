"""Constrained decoding's per-step cost at the embedded model's vocabulary (49,152 tokens):
llguidance filling the packed bitmask (LLExecutor, rows in parallel) and the runner masking the
constrained rows' logits (runner/sampling.py apply_token_bitmask), per batch of constrained
rows (the min of --repeats runs: the box may be shared).

    .venv/bin/python benchmarks/structured_mask.py [--repeats 50]
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import numpy as np
import torch
from llguidance import LLMatcher

from kvserve.models.loader import embedded_model_path
from kvserve.request import StructuredOutput
from kvserve.runner.sampling import apply_token_bitmask
from kvserve.structured.manager import StructuredOutputManager
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


def best_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    hf = load_tokenizer(embedded_model_path())
    manager = StructuredOutputManager(hf, frozenset({hf.eos_token_id}))
    tok = manager.tokenizer
    print(f"vocab {tok.vocab_size}, mask row {manager.mask_width * 4} bytes")
    for label, so, text in WALKS:
        grammar = manager.compile(so)
        tokens = tok.tokenize_str(text)
        for rows in (1, 8, 32, 64):
            walks = []
            for _ in range(max(1, args.repeats // 10)):  # the fastest of several walks
                matchers = [LLMatcher(tok, grammar) for _ in range(rows)]
                elapsed = 0.0
                for token in tokens:  # every fill is of a new state: no mask is reused
                    start = time.perf_counter()
                    manager.fill_bitmask(matchers)
                    elapsed += time.perf_counter() - start
                    assert all(m.consume_token(token) for m in matchers)
                walks.append(elapsed)
            us = min(walks) / len(tokens) * 1e6
            print(
                f"fill  {label:12s} rows {rows:3d}: {us:8.1f} us a step  {us / rows:6.1f} us/row"
                f"  ({len(tokens)} steps)"
            )
    for rows, batch in ((1, 64), (8, 64), (32, 64)):
        logits = torch.randn(batch, tok.vocab_size)
        mask = np.random.default_rng(0).integers(-(2**31), 2**31, (rows, manager.mask_width))
        mask = mask.astype(np.int32)
        call = functools.partial(apply_token_bitmask, logits, list(range(rows)), mask)
        ms = best_ms(call, args.repeats)
        print(f"apply rows {rows:3d} of batch {batch}: {ms:7.3f} ms  {ms / rows * 1e3:6.1f} us/row")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
