"""W3 offline, step by step: 64 requests sharing a 1,024-token prefix (+ 32 tokens each, 32
out) submitted together; prints each of the first steps' wall time and how many requests run
or wait, then the total wall and CPU seconds.  With --no-split the shared-prefix attention
split (attention/shared_prefix.py) is turned off, for an A/B in CPU seconds:

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/w3_steps.py
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/w3_steps.py --no-split
"""

from __future__ import annotations

import argparse
import random
import time

from kvserve import LLM, SamplingParams
from kvserve.allocator import reexec_with_allocator
from kvserve.attention import shared_prefix


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-split", action="store_true")
    parser.add_argument("--show-steps", type=int, default=3)
    args = parser.parse_args()
    reexec_with_allocator()  # the allocator `kvserve serve` runs with (allocator.py)
    if args.no_split:
        shared_prefix.MIN_SHARED_TOKENS = 10**9
    llm = LLM(kv_cache_memory=2 * 2**30, max_model_len=2048)
    rng = random.Random(0)
    prefix = [rng.randrange(100, 40000) for _ in range(1024)]
    prompts = [prefix + [rng.randrange(100, 40000) for _ in range(32)] for _ in range(64)]
    llm.generate([prefix[:100]], SamplingParams(max_tokens=2))  # warm up
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"w3-{i}", prompt, params)
    wall, cpu, steps = time.perf_counter(), time.process_time(), 0
    while engine.has_unfinished_requests():
        started = time.perf_counter()
        engine.step()
        steps += 1
        if steps <= args.show_steps:
            stats = engine.get_stats()
            print(f"step {steps}: {1e3 * (time.perf_counter() - started):.0f} ms, "
                  f"running {stats.num_running}, waiting {stats.num_waiting}")  # fmt: skip
    print(f"W3: {time.perf_counter() - wall:.2f} s wall, {time.process_time() - cpu:.2f} s CPU, "
          f"{steps} steps")  # fmt: skip


if __name__ == "__main__":
    main()
