"""Offline kvserve on W1 (LLM.generate, no HTTP): its time, and where the time goes from a
torch.profiler run on a smaller W1 (--profile-prompts), split by kvserve's profiler ranges:

    linear layers      the projections outside the native path and the LM head (oneDNN /
                       mm kernels; the fused gate_up operator less its SiLU)
    native layers      kvserve::native_layers: the work between attentions in C, where
                       models/native_layers.py serves the model (every step of a bf16 model
                       on an AMX CPU), projections and element-wise together
    attention          kvserve::attention (the paged-attention backend)
    element-wise       the rest of the model's forward (norms, RoPE, SiLU x gate, residuals)
    sampling           kvserve::sample
    detokenization     kvserve::update_detokenize (bookkeeping, detokenizer, stop strings)
    scheduler          kvserve::schedule
    other Python       the remainder of the wall time (engine loop, batch tensors)

    .venv/bin/python benchmarks/profile_offline.py --num-prompts 128 --profile-prompts 32
"""

from __future__ import annotations

import argparse
import json
import random
import time

from torch.profiler import ProfilerActivity, profile

from kvserve import LLM, SamplingParams
from kvserve.allocator import reexec_with_allocator

INPUT_LEN, OUTPUT_LEN = 256, 128
PACKED_OPS = ("kvserve::packed_linear", "kvserve::packed_silu_gate_up")
PLAIN_OPS = ("aten::mm", "aten::addmm")
RANGES = {"attention": "kvserve::attention", "native": "kvserve::native_layers",
          "sampling": "kvserve::sample",
          "detokenization": "kvserve::update_detokenize", "scheduler": "kvserve::schedule",
          "model": "kvserve::model"}  # fmt: skip


def prompts(num: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(INPUT_LEN)] for _ in range(num)]


def run(llm: LLM, num: int, seed: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    started = time.perf_counter()
    llm.generate(prompts(num, seed), params)
    return time.perf_counter() - started


def linear_seconds(totals: dict[str, float]) -> float:
    """The projections' and LM head's time: the packed operators (the gate_up one less the
    SiLU kernel it calls, which is element-wise work), or torch's matrix products where the
    weights are not packed.  The gate_up operator, half of each layer's weights, was counted
    as element-wise before: 24% "element-wise" in an earlier profile."""
    packed = sum(totals.get(name, 0.0) for name in PACKED_OPS)
    if packed:
        inner_silu = totals.get("kvserve::silu_mul", 0.0) if totals.get(PACKED_OPS[1]) else 0.0
        return packed - inner_silu
    return sum(totals.get(name, 0.0) for name in PLAIN_OPS)


def breakdown(llm: LLM, num: int) -> tuple[float, dict[str, float]]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        wall = run(llm, num, seed=1)
    totals: dict[str, float] = {}
    for event in prof.key_averages():
        totals[event.key] = totals.get(event.key, 0.0) + event.cpu_time_total / 1e6
    linear = linear_seconds(totals)
    seconds = {name: totals.get(key, 0.0) for name, key in RANGES.items()}
    shares = {
        "linear layers": linear,
        "native layers": seconds["native"],
        "attention": seconds["attention"],
        "element-wise": seconds["model"]
        - linear
        - seconds["native"]
        - seconds["attention"]
        - seconds["sampling"],
        "sampling": seconds["sampling"],
        "detokenization": seconds["detokenization"],
        "scheduler": seconds["scheduler"],
    }
    shares["other Python"] = wall - sum(shares.values())
    return wall, {name: max(0.0, value) / wall for name, value in shares.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--profile-prompts", type=int, default=32)
    parser.add_argument("--kv-cache-memory", type=int, default=4 * 2**30)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    reexec_with_allocator()  # the allocator `kvserve serve` runs with (allocator.py)
    llm = LLM(kv_cache_memory=args.kv_cache_memory, max_model_len=1024)
    run(llm, 2, seed=2)  # warm up
    w1 = run(llm, args.num_prompts, seed=0)
    wall, shares = breakdown(llm, args.profile_prompts)
    result = {"w1_seconds": w1, "w1_output_tokens_per_second": args.num_prompts * OUTPUT_LEN / w1,
              "profile_prompts": args.profile_prompts, "profile_wall_seconds": wall,
              "breakdown": shares}  # fmt: skip
    print(json.dumps(result) if args.json else json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
