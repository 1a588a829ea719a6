"""One request at a time, offline: the decode attention's time a call (each layer's
`CpuPagedBackend.forward` in a decode step) and the decode step's time (`LLMEngine.step`), on
the embedded model, one prompt of 256 tokens, greedy.  Run it with two source trees (before
and after a change) back to back; the generated token ids are printed to check that outputs
stay identical.

    for src in ../main/src src; do PYTHONPATH=$src .venv/bin/python \\
        benchmarks/decode_attention_calls.py --output-tokens 64; done

The threads are torch's (OMP_NUM_THREADS); the first generate (4 tokens) warms the compiled
layer code and is not counted.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

from kvserve import LLM, SamplingParams
from kvserve.attention.cpu_paged import CpuPagedBackend
from kvserve.engine.llm_engine import LLMEngine


def timed(function: Callable[..., Any], seconds: list[float], keep: Callable[..., bool]):
    """`function`, appending each call's wall time to `seconds` where keep(*args) holds."""

    def wrapper(*args: Any) -> Any:
        started = time.perf_counter()
        result = function(*args)
        if keep(*args):
            seconds.append(time.perf_counter() - started)
        return result

    return wrapper


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--kv-cache-mib", type=int, default=64)
    args = p.parse_args()
    calls: list[float] = []
    steps: list[float] = []
    # Decode steps only: a layer's call without prefills; a step after the first (the prefill).
    CpuPagedBackend.forward = timed(  # type: ignore[method-assign]
        CpuPagedBackend.forward, calls, lambda *a: not a[5].prefills
    )
    LLMEngine.step = timed(LLMEngine.step, steps, lambda *a: True)  # type: ignore[method-assign]
    llm = LLM(kv_cache_memory=args.kv_cache_mib * 2**20, max_model_len=1024)
    prompt = list(range(1000, 1000 + args.prompt_tokens))
    greedy = dict(temperature=0.0, ignore_eos=True)
    llm.generate([prompt], SamplingParams(max_tokens=4, **greedy))
    calls.clear()
    steps.clear()
    out = llm.generate([prompt], SamplingParams(max_tokens=args.output_tokens, **greedy))
    ids = out[0].outputs[0].token_ids
    print(f"token ids: {ids[:8]} ... (sum {sum(ids)})")
    print(f"decode attention: {len(calls)} calls, median {statistics.median(calls) * 1e3:.3f} ms")
    print(f"decode step: median {statistics.median(steps[1:]) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
