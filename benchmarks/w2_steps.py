"""W2's steps offline: a batch of requests decoding while a new 256-token prompt arrives
every few steps, as Poisson arrivals at ~3 requests/s give on this machine.  Prints the
median and mean wall time of the decode-only steps and of the steps that carry a prompt:
their mix is the server's time per output token in W2 (docs/benchmarks.md, W2 online).

    .venv/bin/python benchmarks/w2_steps.py --running 32 --every 4 --steps 200
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import defaultdict

from kvserve import LLM, SamplingParams
from kvserve.allocator import reexec_with_allocator

INPUT_LEN, OUTPUT_LEN = 256, 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--running", type=int, default=32, help="requests decoding at the start")
    parser.add_argument("--every", type=int, default=4, help="steps between new prompts")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    reexec_with_allocator()  # the allocator `kvserve serve` runs with (allocator.py)
    rng = random.Random(args.seed)
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    engine = LLM(kv_cache_memory=2 * 2**30, max_model_len=1024).engine

    def add(request_id: str) -> None:
        engine.add_request(request_id, [rng.randrange(100, 40000) for _ in range(INPUT_LEN)],
                           params)  # fmt: skip

    times: dict[str, list[float]] = defaultdict(list)
    run = engine._run_scheduled

    def timed(output):
        kind = "with a prompt" if any(r.num_tokens > 1 for r in output.scheduled) else "decode"
        started = time.perf_counter()
        result = run(output)
        times[kind].append(time.perf_counter() - started)
        return result

    for i in range(args.running):
        add(f"warm-{i}")
    for _ in range(40):  # every warm request prefilled and decoding
        engine.step()
    engine._run_scheduled = timed
    for step in range(args.steps):
        if step % args.every == 0:
            add(f"new-{step}")
        engine.step()
    for kind, seconds in sorted(times.items()):
        print(f"{kind}: {len(seconds)} steps, median {1e3 * statistics.median(seconds):.1f} ms, "
              f"mean {1e3 * statistics.fmean(seconds):.1f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
