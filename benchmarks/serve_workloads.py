"""Workloads W1-W4 of docs/benchmarks.md against a real `kvserve serve`, through the Python API of
`kvserve bench serve`, optionally followed by the naive baseline (baseline_hf.py) on the same
prompts and KV budget, so the ratios come from one run on one machine.

  W1 throughput      N requests (128), 256 in / 128 out, all at once
  W2 online          W1's shape at a Poisson rate of 70% of W1's measured request throughput
  W3 shared prefix   64 requests: one 1,024-token prefix + 32 unique tokens, 32 out
  W4 memory pressure more concurrent long requests than the KV cache holds (~1/3 fit); all
                     must finish, with KV usage at the cap while requests wait

Each workload writes its bench JSON to --out and its timeline PNG to --img.  W1-W3 share one
server (KV budget --kv-cache-memory); W4 restarts it with a cache sized to hold a third of
its requests.  The server runs on the embedded model in float32 (the baseline's dtype).

    .venv/bin/python benchmarks/serve_workloads.py --workloads w1,w2 --num-prompts 32 --baseline
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from baseline_hf import w1_dataset
from server_process import KVServer

from kvserve.bench.config import BenchConfig, DatasetConfig
from kvserve.bench.plot import plot_timeline
from kvserve.bench.report import format_table, to_json
from kvserve.bench.runner import bench_serve, load_bench_tokenizer
from kvserve.config import parse_size
from kvserve.models.loader import EMBEDDED_NAME


def run_workload(
    name: str, server: KVServer, args: argparse.Namespace, tokenizer: Any, **config: Any
) -> dict:
    """One `kvserve bench serve` run; prints the table, saves JSON and PNG, returns the doc.
    Also records the server's CPU seconds: on a shared machine wall time swings with other
    people's load, while a pinned process's CPU time barely does."""
    dataset = config.pop("dataset")
    bench = BenchConfig(
        base_url=server.base_url,
        model=EMBEDDED_NAME,
        ignore_eos=True,
        label=name,
        dataset=dataset,
        percentile_metrics="ttft,tpot,itl,e2el",
        metric_percentiles="50,90,99",
        **config,
    )
    print(f"\n### {name}", flush=True)
    cpu_before = server.cpu_seconds()
    result = bench_serve(bench, tokenizer=tokenizer)
    cpu = server.cpu_seconds() - cpu_before
    print(format_table(result), flush=True)
    doc = to_json(result)
    doc["server_cpu_seconds"] = cpu
    doc["output_tokens_per_cpu_second"] = doc["total_output_tokens"] / cpu
    print(
        f"server CPU time {cpu:.1f} s: {doc['output_tokens_per_cpu_second']:.2f} output "
        "tokens per CPU second",
        flush=True,
    )
    out = Path(args.out) / f"{name.lower()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2))
    plot_timeline(doc, Path(args.img) / f"bench_{name.lower()}.png")
    return doc


def run_w1_to_w3(args: argparse.Namespace, tokenizer: Any, selected: set[str]) -> dict:
    """W1, W2 (rate from W1 unless --w2-rate) and W3 on one server."""
    docs: dict[str, dict] = {}
    server_args = ["--kv-cache-memory", args.kv_cache_memory]
    server_args += ["--max-model-len", str(args.max_model_len)]
    server_args += ["--kv-cache-dtype", args.kv_cache_dtype]
    with KVServer(server_args, Path(args.out), args.cpus) as server:
        if "w1" in selected or ("w2" in selected and args.w2_rate is None):
            docs["W1"] = run_workload("W1", server, args, tokenizer, dataset=w1_dataset(args))
        if "w2" in selected:
            rate = args.w2_rate or 0.7 * docs["W1"]["request_throughput"]
            docs["W2"] = run_workload(
                "W2", server, args, tokenizer, dataset=w1_dataset(args), request_rate=rate
            )
        if "w3" in selected:
            dataset = DatasetConfig(
                dataset_name="prefix",
                num_prompts=args.w3_num_prompts,
                prefix_len=1024,
                suffix_len=32,
                output_len=32,
                seed=args.seed,
            )
            docs["W3"] = run_workload("W3", server, args, tokenizer, dataset=dataset)
    return docs


def w4_kv_bytes(args: argparse.Namespace) -> int:
    """A cache holding ~1/3 of W4's requests at full length, in whole blocks."""
    from kvserve.kv.spec import kv_cache_spec
    from kvserve.models.loader import embedded_model_path
    from kvserve.planner.gguf_meta import read_gguf_shape

    shape = read_gguf_shape(embedded_model_path())
    spec = kv_cache_spec(
        shape.num_layers, shape.num_kv_heads, shape.head_dim, "auto", "float32", block_size=16
    )
    seq_blocks = spec.num_blocks_for_tokens(args.w4_input_len + args.w4_output_len)
    fitting = math.ceil(args.w4_num_prompts / 3)
    return fitting * seq_blocks * spec.bytes_per_block


def run_w4(args: argparse.Namespace, tokenizer: Any) -> dict:
    max_len = args.w4_input_len + args.w4_output_len
    server_args = ["--kv-cache-memory", str(w4_kv_bytes(args)), "--max-model-len", str(max_len)]
    dataset = DatasetConfig(
        num_prompts=args.w4_num_prompts,
        random_input_len=args.w4_input_len,
        random_output_len=args.w4_output_len,
        seed=args.seed,
    )
    with KVServer(server_args, Path(args.out), args.cpus) as server:
        return run_workload("W4", server, args, tokenizer, dataset=dataset)


def run_baseline(args: argparse.Namespace, docs: dict[str, dict]) -> dict:
    """The HF static-batch baseline on W1's prompts and budget (and W2's arrival rate), once
    per reservation mode: {mode: {"W1": ..., "W2": ...}}."""
    import baseline_hf

    base = baseline_hf.load_baseline_model(args.cpus)
    requests = baseline_hf.w1_requests(base.tokenizer, args)
    out: dict[str, dict] = {}
    for mode in args.baseline_reserve.split(","):
        reserved = baseline_hf.reserved_length(
            mode, args.input_len, args.output_len, args.range_ratio, args.max_model_len
        )
        runs: dict[str, dict] = {}
        for name in ("W1", "W2"):
            if name not in docs:
                continue
            rate = math.inf if name == "W1" else docs["W2"]["config"]["request_rate"]
            print(f"\n### baseline ({mode}: {reserved} tokens reserved), {name}", flush=True)
            runs[name] = baseline_hf.run_baseline(
                base, requests, parse_size(args.kv_cache_memory), reserved, rate, args.seed
            )
            print(json.dumps(runs[name], indent=2), flush=True)
        out[mode] = runs
    return out


def ratios(docs: dict[str, dict], baseline: dict[str, dict]) -> dict[str, dict[str, float]]:
    """kvserve / baseline throughput (higher is better for kvserve) and baseline / kvserve
    mean end-to-end latency (higher is better for kvserve), per workload."""
    rows = {}
    for name, base in baseline.items():
        ours = docs[name]
        row = {
            "request_throughput": ours["request_throughput"] / base["request_throughput"],
            "output_throughput": ours["output_throughput"] / base["output_throughput"],
        }
        if "cpu_seconds" in base and "server_cpu_seconds" in ours:
            row["output_tokens_per_cpu_second"] = (
                ours["output_tokens_per_cpu_second"] / base["output_tokens_per_cpu_second"]
            )
        if "mean_e2el_ms" in base:
            row["mean_e2el_baseline_over_kvserve"] = base["mean_e2el_ms"] / ours["mean_e2el_ms"]
        rows[name] = row
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workloads", default="w1,w2,w3,w4", help="comma-separated subset")
    p.add_argument("--num-prompts", type=int, default=128, help="W1/W2 requests")
    p.add_argument("--input-len", type=int, default=256, help="W1/W2 prompt tokens")
    p.add_argument("--output-len", type=int, default=128, help="W1/W2 output tokens")
    p.add_argument(
        "--range-ratio", type=float, default=0.0, help="W1/W2 lengths vary by +-this fraction"
    )
    p.add_argument("--kv-cache-memory", default="512MiB", help="W1-W3 and baseline budget")
    p.add_argument(
        "--max-model-len",
        type=int,
        default=2048,
        help="W1-W3 server's, and what the baseline "
        "reserves per sequence with --baseline-reserve max-model-len",
    )
    p.add_argument(
        "--kv-cache-dtype", default="auto", help="W1-W3 server's (the baseline's is float32)"
    )
    p.add_argument(
        "--baseline-reserve",
        default="max-model-len,request",
        help="baseline reservation modes to run (baseline_hf.py --reserve), comma-separated",
    )
    p.add_argument("--w2-rate", type=float, default=None, help="skip W1's measurement")
    p.add_argument("--w3-num-prompts", type=int, default=64)
    p.add_argument("--w4-num-prompts", type=int, default=24)
    p.add_argument("--w4-input-len", type=int, default=512)
    p.add_argument("--w4-output-len", type=int, default=128)
    p.add_argument("--baseline", action="store_true", help="then run HF on W1 (and W2)")
    p.add_argument("--cpus", default=None, help="pin server and baseline, e.g. 0 or 0,1")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--replot", action="store_true", help="only redraw PNGs from --out JSONs")
    p.add_argument("--out", default="results/serve")
    p.add_argument("--img", default="docs/img")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    selected = {w.strip().lower() for w in args.workloads.split(",")}
    if args.replot:
        for name in sorted(selected):
            doc = json.loads((Path(args.out) / f"{name}.json").read_text())
            print(plot_timeline(doc, Path(args.img) / f"bench_{name}.png"))
        return 0
    tokenizer = load_bench_tokenizer(None, EMBEDDED_NAME)
    docs = run_w1_to_w3(args, tokenizer, selected) if selected & {"w1", "w2", "w3"} else {}
    if "w4" in selected:
        docs["W4"] = run_w4(args, tokenizer)
    summary: dict[str, Any] = {"argv": sys.argv, "kvserve": {k: _short(d) for k, d in docs.items()}}
    if args.baseline:
        summary["baseline"] = run_baseline(args, docs)
        summary["ratios"] = {mode: ratios(docs, runs) for mode, runs in summary["baseline"].items()}
    path = Path(args.out) / "summary.json"
    path.write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: v for k, v in summary.items() if k != "argv"}, indent=2))
    print(f"summary saved to {path}")
    return 0


def _short(doc: dict) -> dict:
    keys = (
        "completed",
        "failed",
        "duration",
        "request_throughput",
        "output_throughput",
        "total_token_throughput",
        "mean_ttft_ms",
        "p99_ttft_ms",
        "mean_tpot_ms",
        "mean_e2el_ms",
        "p99_e2el_ms",
        "memory",
        "server_cpu_seconds",
        "output_tokens_per_cpu_second",
    )
    return {"request_rate": doc["config"]["request_rate"], **{k: doc.get(k) for k in keys}}


if __name__ == "__main__":
    sys.exit(main())
