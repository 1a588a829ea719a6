"""What prefix caching costs when nothing hits: offline W1 (N x 256 random tokens in / 128 out,
all at once) on two engines in one process, one with prefix caching on and one with it off,
alternating, each round on prompts neither engine has seen (so the cache never hits).  Prints
each round's seconds and the ratio of the medians (the target: on costs at most 2%).

    .venv/bin/python benchmarks/prefix_caching_cost.py --num-prompts 128 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from kvserve import LLM, SamplingParams
from kvserve.allocator import reexec_with_allocator

INPUT_LEN, OUTPUT_LEN = 256, 128


def prompts(num: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(INPUT_LEN)] for _ in range(num)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kv-cache-memory", type=int, default=2 * 2**30)
    args = parser.parse_args()
    reexec_with_allocator()  # the allocator `kvserve serve` runs with (allocator.py)
    engines = {
        caching: LLM(kv_cache_memory=args.kv_cache_memory, max_model_len=1024,
                     enable_prefix_caching=caching)
        for caching in (True, False)
    }  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    for caching, llm in engines.items():  # warm up: compile, first touches
        llm.generate(prompts(8, seed=1000 + caching), params)
    seconds: dict[bool, list[float]] = {True: [], False: []}
    seed = 0
    for _ in range(args.rounds):
        for caching, llm in engines.items():
            seed += 1  # fresh prompts: 0% hits
            started = time.perf_counter()
            llm.generate(prompts(args.num_prompts, seed), params)
            seconds[caching].append(time.perf_counter() - started)
    on, off = statistics.median(seconds[True]), statistics.median(seconds[False])
    print(json.dumps({"on_seconds": seconds[True], "off_seconds": seconds[False],
                      "on_over_off": on / off}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
