"""Workload W3 (docs/benchmarks.md): 64 requests sharing one 1,024-token prefix + 32 unique tokens,
32 output tokens each, all submitted at once; prefix caching on vs off in one run.

Offline, on the engine (no HTTP): TTFT is the time from submission to the step that produced
a request's first token.  Reports the mean-TTFT ratio, the throughput ratio and the hit rate.

    .venv/bin/python benchmarks/w3_prefix_caching.py --out docs/img/w3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from kvserve import LLM, SamplingParams


def make_prompts(num: int, prefix_len: int, suffix_len: int, vocab: int) -> list[list[int]]:
    prefix = [(j * 7919) % (vocab - 100) + 50 for j in range(prefix_len)]
    return [
        prefix + [(i * 104729 + j * 31) % (vocab - 100) + 50 for j in range(suffix_len)]
        for i in range(num)
    ]


def run_once(caching: bool, prompts: list[list[int]], output_len: int, kv_bytes: int) -> dict:
    llm = LLM(kv_cache_memory=kv_bytes, max_model_len=2048, enable_prefix_caching=caching)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    started = time.monotonic()
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    ttft: dict[str, float] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            ttft.setdefault(out.request_id, time.monotonic() - started)
    duration = time.monotonic() - started
    stats = engine.get_stats()
    return {
        "prefix_caching": caching,
        "mean_ttft_s": statistics.mean(ttft.values()),
        "median_ttft_s": statistics.median(ttft.values()),
        "duration_s": duration,
        "output_tokens_per_s": len(prompts) * output_len / duration,
        "prefix_cache_hit_rate": (
            stats.prefix_cache_hits / stats.prefix_cache_queries
            if stats.prefix_cache_queries
            else 0
        ),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--kv-cache-memory", type=int, default=2 * 2**30)
    p.add_argument("--out", default="results/w3")
    args = p.parse_args()
    prompts = make_prompts(args.num_requests, args.prefix_len, args.suffix_len, 49152)
    on = run_once(True, prompts, args.output_len, args.kv_cache_memory)
    off = run_once(False, prompts, args.output_len, args.kv_cache_memory)
    result = {
        "on": on,
        "off": off,
        "mean_ttft_ratio_off_over_on": off["mean_ttft_s"] / on["mean_ttft_s"],
        "throughput_ratio_on_over_off": on["output_tokens_per_s"] / off["output_tokens_per_s"],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "w3.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
