"""--scheduling-policy fcfs against lpm, offline, in one run: a queue of requests sharing a few
long prefixes, shuffled, all submitted at once, a KV cache too small to hold every prefix.

FCFS admits them in arrival order, so the prefixes take turns in the cache and each comes
back evicted; LPM admits first the requests whose prefix is cached, so each prefix is
computed about once.  Reports per policy the total time, the prefill tokens computed, the
prefix hit rate, the waits (submission to the step that admitted the request) and the time
spent choosing whom to admit.  Aging: every request arrives at once, so those still waiting
after --max-wait-s are all aged, and lpm must then admit them in arrival order (checked:
`admitted_after_bound_in_arrival_order`); its maximum wait is the bound plus the time those
take, which fcfs's maximum wait bounds from above.

    .venv/bin/python benchmarks/scheduling_policy.py  # 4 prefixes x 6 requests, 20 blocks

The defaults fit a small, busy CPU in about 4 minutes (float32, 46,080 bytes a token: 15 MB
is 20 blocks of 16, two prefixes of 128 tokens and their suffixes); scale --prefix-len,
--requests-per-prefix and --kv-cache-memory together on a bigger machine.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from kvserve import LLM, SamplingParams
from kvserve.engine.llm_engine import LLMEngine

VOCAB = 49152  # the embedded model's


def make_prompts(args: argparse.Namespace) -> list[list[int]]:
    """`num_prefixes` x `requests_per_prefix` prompts (prefix + a unique suffix), shuffled."""
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(50, VOCAB - 50) for _ in range(args.prefix_len)]
                for _ in range(args.num_prefixes)]  # fmt: skip
    prompts = [
        prefix + [rng.randrange(50, VOCAB - 50) for _ in range(args.suffix_len)]
        for prefix in prefixes
        for _ in range(args.requests_per_prefix)
    ]
    rng.shuffle(prompts)
    return prompts


def timed_schedule(engine: LLMEngine) -> list[float]:
    """Wrap the scheduler's schedule() to add up its time (the policy's cost included)."""
    spent = [0.0]
    schedule = engine.scheduler.schedule

    def wrapped():  # noqa: ANN202
        started = time.perf_counter()
        try:
            return schedule()
        finally:
            spent[0] += time.perf_counter() - started

    engine.scheduler.schedule = wrapped  # type: ignore[method-assign]
    return spent


def run_once(policy: str, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    max_model_len = args.prefix_len + args.suffix_len + args.output_len + 16
    llm = LLM(
        kv_cache_memory=args.kv_cache_memory, max_model_len=max_model_len,
        dtype="float32", scheduling_policy=policy, max_num_seqs=args.max_num_seqs,
        scheduling_max_wait_s=args.max_wait_s,
    )  # fmt: skip
    engine = llm.engine
    spent = timed_schedule(engine)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    started = time.monotonic()
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params, arrival_time=started)
    waiting = {str(i) for i in range(len(prompts))}
    waits: list[float] = []
    aged: list[int] = []  # admitted after waiting max_wait_s: in submission order if fair
    while engine.has_unfinished_requests():
        step_start = time.monotonic()
        engine.step()
        for rid in sorted(waiting, key=int):
            if engine.scheduler.requests[rid].num_cached_tokens >= 0:  # admitted
                waiting.discard(rid)
                waits.append(step_start - started)
                if step_start - started >= args.max_wait_s:
                    aged.append(int(rid))
    duration = time.monotonic() - started
    stats = engine.get_stats()
    engine.close()
    return {
        "policy": policy,
        "duration_s": round(duration, 2),
        "num_blocks": engine.sizing.num_blocks,
        "prefill_tokens_computed": stats.prefix_cache_queries - stats.prefix_cache_hits,
        "prefix_cache_hit_rate": round(stats.prefix_cache_hits / stats.prefix_cache_queries, 3),
        "num_preemptions": stats.num_preemptions,
        "max_wait_s": round(max(waits), 2),
        "mean_wait_s": round(statistics.mean(waits), 2),
        "schedule_ms_total": round(spent[0] * 1000, 1),
        "num_admitted_after_bound": len(aged),
        "admitted_after_bound_in_arrival_order": aged == sorted(aged),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--num-prefixes", type=int, default=4)
    p.add_argument("--requests-per-prefix", type=int, default=6)
    p.add_argument("--prefix-len", type=int, default=128)
    p.add_argument("--suffix-len", type=int, default=8)
    p.add_argument("--output-len", type=int, default=2)
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--max-wait-s", type=float, default=60.0, help="--scheduling-max-wait-s")
    p.add_argument("--kv-cache-memory", type=int, default=15_000_000, help="bytes")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    prompts = make_prompts(args)
    fcfs = run_once("fcfs", prompts, args)
    lpm = run_once("lpm", prompts, args)
    result = {
        "fcfs": fcfs,
        "lpm": lpm,
        "duration_ratio_fcfs_over_lpm": round(fcfs["duration_s"] / lpm["duration_s"], 2),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
