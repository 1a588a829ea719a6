"""Workload W4 (docs/benchmarks.md): more concurrent long requests than the KV cache holds.

Runs the engine offline on the embedded model, records KV usage, running/waiting counts and
preemptions after every step, and checks that every request finishes.  Writes a JSON record
and a PNG of the usage timeline.

    .venv/bin/python benchmarks/w4_memory_pressure.py --out results/w4
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from kvserve import LLM, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--num-requests", type=int, default=24)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--fits", type=float, default=6.0, help="sequences the KV cache holds")
    p.add_argument("--out", default="results/w4")
    args = p.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    seq_blocks = -(-(args.input_len + args.output_len) // 16)
    bytes_per_block = 16 * 46_080  # embedded model, float32 KV (see kv/spec.py)
    kv_bytes = int(args.fits * seq_blocks) * bytes_per_block
    llm = LLM(kv_cache_memory=kv_bytes, max_model_len=args.input_len + args.output_len)
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    for i in range(args.num_requests):
        prompt = [(i * 7919 + j * 104729) % (vocab - 100) + 50 for j in range(args.input_len)]
        engine.add_request(f"w4-{i}", prompt, params)

    timeline, finished, started = [], 0, time.monotonic()
    while engine.has_unfinished_requests():
        finished += sum(o.finished for o in engine.step())
        s = engine.get_stats()
        timeline.append({
            "t": time.monotonic() - started, "kv_usage": s.kv_cache_usage,
            "running": s.num_running, "waiting": s.num_waiting,
            "preemptions": s.num_preemptions, "finished": finished,
        })  # fmt: skip
    duration = time.monotonic() - started
    result = summarize(args, engine, timeline, finished, duration)
    (out_dir / "w4.json").write_text(json.dumps({"summary": result, "timeline": timeline}))
    plot(timeline, out_dir / "w4_kv_usage.png")
    print(json.dumps(result, indent=2))


def summarize(args, engine, timeline, finished, duration) -> dict:
    usage = [x["kv_usage"] for x in timeline]
    busy = [u for x, u in zip(timeline, usage, strict=True) if x["waiting"] > 0]
    return {
        "num_requests": args.num_requests,
        "finished": finished,
        "kv_blocks": engine.sizing.num_blocks,
        "max_concurrency_at_full_length": engine.sizing.max_concurrency,
        "steps": len(timeline),
        "preemptions": timeline[-1]["preemptions"],
        "peak_kv_usage": max(usage),
        "mean_kv_usage_while_requests_wait": sum(busy) / len(busy) if busy else None,
        "final_kv_usage": usage[-1],
        "output_tokens_per_s": args.num_requests * args.output_len / duration,
        "duration_s": duration,
    }


def plot(timeline: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [x["t"] for x in timeline]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot(t, [100 * x["kv_usage"] for x in timeline], label="KV cache usage %")
    ax.set_ylabel("KV usage %")
    ax.set_ylim(0, 105)
    ax.set_xlabel("seconds")
    ax2 = ax.twinx()
    ax2.plot(t, [x["running"] for x in timeline], "g--", label="running")
    ax2.plot(t, [x["waiting"] for x in timeline], "r:", label="waiting")
    ax2.plot(t, [x["finished"] for x in timeline], "k-.", label="finished")
    ax2.set_ylabel("requests")
    fig.legend(loc="upper right")
    ax.set_title("W4: memory pressure (kvserve, embedded SmolLM2-135M)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
