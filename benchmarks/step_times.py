"""Offline W1 step by step: each engine step's wall time by kind (decode-only or with a
prefill), and the compute threads' voluntary context switches (OpenMP threads that sleep at
their barriers instead of spinning show up there by the tens of thousands).

    .venv/bin/python benchmarks/step_times.py --num-prompts 128
    .venv/bin/python benchmarks/step_times.py --num-prompts 32           # W2-sized decode steps
    .venv/bin/python benchmarks/step_times.py --generate-on-thread       # stepped on a 2nd thread
    .venv/bin/python benchmarks/step_times.py --generate-on-thread --build-on-thread

The last two reproduce the served set-up before `AsyncLLM.launch`: an engine built on the main
thread and stepped on another (two OpenMP teams), and one built on a thread that then exited.
"""

from __future__ import annotations

import argparse
import os
import random
import threading
import time
from collections import defaultdict

from kvserve import LLM, SamplingParams
from kvserve.allocator import reexec_with_allocator
from kvserve.engine.llm_engine import LLMEngine

INPUT_LEN, OUTPUT_LEN = 256, 128


def on_thread(fn, use_thread: bool):
    """fn() on a new thread that then exits (or here), and its result."""
    box = []
    if not use_thread:
        return fn()
    worker = threading.Thread(target=lambda: box.append(fn()))
    worker.start()
    worker.join()
    return box[0]


def timed_steps(engine: LLMEngine) -> dict[str, list[float]]:
    """Wrap the engine's step execution to record wall seconds per step kind."""
    times: dict[str, list[float]] = defaultdict(list)
    run = engine._run_scheduled

    def timed(output):
        kind = "decode" if all(r.num_tokens == 1 for r in output.scheduled) else "prefill"
        started = time.perf_counter()
        result = run(output)
        times[kind].append(time.perf_counter() - started)
        return result

    engine._run_scheduled = timed
    return times


def voluntary_switches() -> dict[str, int]:
    """Voluntary context switches of this process's threads that ran for more than 0.1 s."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        stat = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        if (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK") < 0.1:
            continue
        for line in open(f"/proc/self/task/{tid}/status"):
            if line.startswith("voluntary_ctxt_switches"):
                out[tid] = int(line.split()[1])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--build-on-thread", action="store_true")
    parser.add_argument("--generate-on-thread", action="store_true")
    args = parser.parse_args()
    reexec_with_allocator()  # the allocator `kvserve serve` runs with (allocator.py)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(INPUT_LEN)]
               for _ in range(args.num_prompts)]  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)

    def build() -> LLM:
        llm = LLM(kv_cache_memory=4 * 2**30, max_model_len=1024)
        llm.generate(prompts[:2], params)  # warm up
        return llm

    llm = on_thread(build, args.build_on_thread)
    times = timed_steps(llm.engine)
    started = time.perf_counter()
    on_thread(lambda: llm.generate(prompts, params), args.generate_on_thread)
    wall = time.perf_counter() - started
    for kind, seconds in sorted(times.items()):
        print(f"{kind}: {len(seconds)} steps, {sum(seconds):.2f} s, "
              f"{1e3 * sum(seconds) / len(seconds):.1f} ms a step")  # fmt: skip
    print(f"W1 ({args.num_prompts} prompts): {wall:.2f} s, "
          f"{args.num_prompts * OUTPUT_LEN / wall:.1f} output tok/s")  # fmt: skip
    print("voluntary context switches of the busy threads:", voluntary_switches())


if __name__ == "__main__":
    main()
