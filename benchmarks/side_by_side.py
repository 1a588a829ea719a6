"""kvserve against another OpenAI-compatible server, one after the other, same model, same
workloads, same client (`kvserve bench serve`), plus the hardware bound, in one run.

    .venv/bin/python benchmarks/side_by_side.py --out results/sbs \\
        --other-name vllm-cpu \\
        --other-cmd "VLLM_CPU_OMP_THREADS_BIND=0-1 vllm serve SMOLLM2_HF_DIR \\
                     --port {port} --block-size 32 --served-model-name {model}"

1. The bound: the model's linear layers alone (every projection and the LM head of the
   sampled rows, at W1's shapes: prefill chunks of --max-num-batched-tokens rows, then one
   decode step per output token over the whole batch), timed in this process with the
   threads kvserve uses.  kvserve's offline W1 and served W1 are reported as multiples of it.
   With the profile on, the bound is measured again after the offline run and the multiples
   are taken of the two measurements' mean: the machine's speed drifts by 2-3x within
   minutes (docs/benchmarks.md), and one measurement minutes away from the run
   it divides made the multiple of one build read 1.69x and 4.04x.  Beside it, the floor of
   the attention it leaves out (W1's K/V reads at the streaming rate), and the offline W1's
   multiple of the bound plus that floor.
2. A profile of offline kvserve on a scaled-down W1 (torch.profiler with kvserve's ranges):
   linear layers, attention, element-wise, sampling, scheduler and Python, and
   detokenization; HTTP is the served W1 time beyond the offline one.
3. Each server is started (kvserve with --kvserve-args; the other with --other-cmd, whose
   {port} and {model} are filled in), W1 then W3 then W2 (Poisson at 70% of the other
   server's W1 request rate) are run against it, and it is stopped.  The ratios printed are
   kvserve over the other: output tok/s, duration, TTFT and TPOT p50/p99.  With --rounds N
   the comparison runs N times, alternating which server goes first: this machine's speed
   drifts within a run, which favours whichever server runs first; the geometric mean of the
   rounds' ratios cancels a steady drift.

Workloads (docs/benchmarks.md): W1 = N x 256 in / 128 out all at once; W3 = 64 x (1,024
shared + 32) in / 32 out; W2 = W1's shape (other prompts, so that no server finds them in its
prefix cache) at a Poisson rate (after W1, whose rate it takes); W5 = 8 x 7,936 in / 128 out
all at once (long context: the KV cache decides the step time) and W5D its decode-heavy
variant, 8 x 7,680 in / 512 out (8,192 tokens: the embedded model's context).  --workloads
picks them, in its order; --skip-bound leaves out step 1 (what the long-context workloads do
not need):

    .venv/bin/python benchmarks/side_by_side.py --skip-bound --skip-profile \
        --workloads w5,w5d --kvserve-args "--kv-cache-dtype int4 --max-model-len 8192 \
        --kv-cache-memory 1GiB" --other-name vllm-cpu --other-cmd "..."
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from kvserve.bench.config import BenchConfig, DatasetConfig
from kvserve.bench.launcher import ServerProcess, free_port, serve_command, start_server
from kvserve.bench.report import to_json
from kvserve.bench.runner import bench_serve, load_bench_tokenizer
from kvserve.models.loader import EMBEDDED_NAME

START_TIMEOUT_S = 600.0
KEYS = [
    ("output_throughput", "output tok/s", "higher"),
    ("duration", "duration s", "lower"),
    ("median_ttft_ms", "TTFT p50 ms", "lower"),
    ("p99_ttft_ms", "TTFT p99 ms", "lower"),
    ("median_tpot_ms", "TPOT p50 ms", "lower"),
    ("p99_tpot_ms", "TPOT p99 ms", "lower"),
]


# ---------------------------------------------------------------------- servers
class Server:
    """A server command line (run by bash, so it may set variables), started on entry, ready
    once /health answers, stopped on exit: kvserve.bench.launcher does all three."""

    def __init__(self, name: str, command: str, port: int, log_dir: Path) -> None:
        self.name, self.command, self.port, self.log_dir = name, command, port, log_dir
        self.process: ServerProcess | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Server:
        print(f"$ {self.command}", flush=True)
        self.process = start_server(["bash", "-c", self.command], self.port, self.log_dir)
        try:
            self.process.wait_healthy(START_TIMEOUT_S)
        except BaseException:
            self.process.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process is not None:
            self.process.stop()


def kvserve_command(port: int, args: str) -> str:
    return shlex.join(serve_command(port, ["--disable-uvicorn-access-log", *shlex.split(args)]))


# ---------------------------------------------------------------------- workloads
def w1(args: argparse.Namespace) -> DatasetConfig:
    return DatasetConfig(num_prompts=args.num_prompts, random_input_len=256,
                         random_output_len=128, seed=args.seed)  # fmt: skip


def w2(args: argparse.Namespace) -> DatasetConfig:
    """W1's shape with other prompts: after W1 on the same server, W1's own prompts would be
    prefix-cache hits (an advantage to whichever server ran W1 first in the same process)."""
    return DatasetConfig(num_prompts=args.num_prompts, random_input_len=256,
                         random_output_len=128, seed=args.seed + 1)  # fmt: skip


def w3(args: argparse.Namespace) -> DatasetConfig:
    return DatasetConfig(dataset_name="prefix", num_prompts=64, prefix_len=1024, suffix_len=32,
                         output_len=32, seed=args.seed)  # fmt: skip


def w5(args: argparse.Namespace) -> DatasetConfig:
    """Long context: 8 prompts of 7,936 tokens, 128 out each, all at once."""
    return DatasetConfig(num_prompts=8, random_input_len=7936, random_output_len=128,
                         seed=args.seed + 4)  # fmt: skip


def w5d(args: argparse.Namespace) -> DatasetConfig:
    """8 prompts of 7,680 tokens, 512 out each (8,192 in all, the embedded model's context):
    the decode steps over 8 x 8K of K/V dominate."""
    return DatasetConfig(num_prompts=8, random_input_len=7680, random_output_len=512,
                         seed=args.seed + 4)  # fmt: skip


# Run all at once, in --workloads order (W2 apart: it needs a request rate).
WORKLOADS = {"w1": w1, "w3": w3, "w5": w5, "w5d": w5d}


def sampling(args: argparse.Namespace) -> dict[str, float | None]:
    """The requests' sampling fields, as BenchConfig takes them (None: the server's default):
    greedy unless --temperature says otherwise."""
    return {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}


def run_bench(server: Server, name: str, dataset: DatasetConfig, tokenizer: Any,
              rate: float = float("inf"),
              sampled: dict[str, float | None] | None = None) -> dict:  # fmt: skip
    config = BenchConfig(
        base_url=server.base_url, model=EMBEDDED_NAME, ignore_eos=True, dataset=dataset,
        label=f"{server.name} {name}", request_rate=rate, disable_tqdm=True,
        percentile_metrics="ttft,tpot,itl,e2el", metric_percentiles="50,99", **(sampled or {}),
    )  # fmt: skip
    doc = to_json(bench_serve(config, tokenizer=tokenizer))
    print(
        f"  {server.name} {name}: {doc['output_throughput']:.1f} out tok/s, "
        f"{doc['duration']:.1f} s, TTFT p50 {doc['median_ttft_ms']:.0f} ms, "
        f"TPOT p50 {doc['median_tpot_ms']:.0f} ms, failed {doc['failed']}",
        flush=True,
    )
    return {k: v for k, v in doc.items() if k not in ("requests", "timeline")}


def serve_and_bench(server: Server, args: argparse.Namespace, tokenizer: Any,
                    w2_rate: float | None) -> dict[str, dict]:  # fmt: skip
    """The --workloads in order (W2 last, when its rate is known) against one server."""
    results = {}
    with server:
        for name in args.workloads.split(","):
            if name in WORKLOADS:
                dataset = WORKLOADS[name](args)
                results[name.upper()] = run_bench(
                    server, name.upper(), dataset, tokenizer, sampled=sampling(args)
                )
        if w2_rate is not None:
            results["W2"] = run_bench(server, "W2", w2(args), tokenizer, w2_rate, sampling(args))
    return results


# ---------------------------------------------------------------------- the bound + profile
def run_json_script(name: str, *flags: str) -> dict[str, Any]:
    """Run benchmarks/NAME with --json in a separate process (its own torch threads and
    memory) and return the JSON it prints last."""
    command = [sys.executable, str(Path(__file__).with_name(name)), *flags, "--json"]
    out = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure_bound(args: argparse.Namespace) -> dict[str, Any]:
    """Seconds of linear-layer work W1 needs (linear_bound.py)."""
    batched = str(args.max_num_batched_tokens)
    return run_json_script("linear_bound.py", "--num-prompts", str(args.num_prompts),
                           "--max-num-batched-tokens", batched)  # fmt: skip


def profile_offline(args: argparse.Namespace) -> dict[str, Any]:
    """Offline W1 timing and the profile breakdown (profile_offline.py)."""
    return run_json_script("profile_offline.py", "--num-prompts", str(args.num_prompts),
                           "--profile-prompts", str(args.profile_prompts))  # fmt: skip


# ---------------------------------------------------------------------- report
def ratios(kv: dict[str, dict], other: dict[str, dict], other_name: str) -> list[str]:
    lines = [f"| workload | metric | kvserve | {other_name} | kvserve advantage |",
             "|---|---|---:|---:|---:|"]  # fmt: skip
    for workload in kv:
        if workload not in other:
            continue
        for key, label, better in KEYS:
            a, b = kv[workload].get(key), other[workload].get(key)
            if a is None or b is None or not a or not b:
                continue
            gain = a / b if better == "higher" else b / a
            lines.append(f"| {workload} | {label} | {a:.1f} | {b:.1f} | {gain:.2f}x |")
    return lines


def mean_ratios(rounds: list[dict[str, dict]], other_name: str) -> list[str]:
    """kvserve's advantage per workload and metric, the geometric mean over rounds."""
    lines = [f"| workload | metric | kvserve advantage over {other_name} |", "|---|---|---:|"]
    for workload in rounds[0]["kvserve"]:
        for key, label, better in KEYS:
            gains = []
            for results in rounds:
                a = results["kvserve"].get(workload, {}).get(key)
                b = results["other"].get(workload, {}).get(key)
                if a and b:
                    gains.append(a / b if better == "higher" else b / a)
            if len(gains) == len(rounds):
                mean = math.exp(sum(math.log(g) for g in gains) / len(gains))
                lines.append(f"| {workload} | {label} | {mean:.2f}x |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results/side_by_side"))
    parser.add_argument("--kvserve-args", default="--kv-cache-memory 4GiB --max-model-len 2048")
    parser.add_argument("--other-cmd", default=None, help="Shell command; {port} and {model}.")
    parser.add_argument("--other-name", default="other")
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--profile-prompts", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--workloads", default="w1,w3,w2")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-profile", action="store_true")
    parser.add_argument("--skip-bound", action="store_true",
                        help="Leave out the bound (and the profile).")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=1,
                        help="Compare the servers this many times, alternating which goes "
                             "first (the machine's speed drifts during a run), and report "
                             "each round and their geometric mean.")  # fmt: skip
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="Every request's temperature (0, the default: greedy).")  # fmt: skip
    parser.add_argument("--top-p", type=float, default=None, help="Every request's top-p.")
    parser.add_argument("--top-k", type=int, default=None, help="Every request's top-k.")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    if not args.skip_bound:
        print("# bound (linear layers alone at W1's shapes)", flush=True)
        report["bound"] = measure_bound(args)
        print(json.dumps(report["bound"]), flush=True)
    if not (args.skip_profile or args.skip_bound):
        print("# offline kvserve: W1 and the profile breakdown", flush=True)
        report["offline"] = profile_offline(args)
        print(json.dumps(report["offline"], indent=1), flush=True)
        print("# the bound again, after the offline run", flush=True)
        report["bound_after"] = measure_bound(args)
        print(json.dumps(report["bound_after"]), flush=True)
    tokenizer = load_bench_tokenizer(None, EMBEDDED_NAME)
    report["rounds"] = []
    rate = None  # W2's: 70% of the other server's W1 request rate in the first round
    for index in range(args.rounds):
        other_first = index % 2 == 0
        print(f"# round {index + 1}: {args.other_name if other_first else 'kvserve'} first",
              flush=True)  # fmt: skip
        results = one_round(args, tokenizer, other_first, rate)
        if results["other"].get("W1") and rate is None:
            rate = 0.7 * results["other"]["W1"]["request_throughput"]
            if "w2" in args.workloads:  # the other server ran before its W2 rate was known
                results["other"]["W2"] = other_w2(args, tokenizer, rate)
        report["rounds"].append(results)
    report.update(kvserve=report["rounds"][0]["kvserve"], other=report["rounds"][0]["other"])
    summarize(report, args)
    (args.out / "side_by_side.json").write_text(json.dumps(report, indent=2))
    return 0


def one_round(args: argparse.Namespace, tokenizer: Any, other_first: bool,
              rate: float | None) -> dict[str, dict]:  # fmt: skip
    """Each server started, benchmarked and stopped in turn.  Without a W2 rate yet, the first
    server to run (the other) skips W2, and the rate comes from its W1."""
    w2_rate = rate if "w2" in args.workloads else None
    results: dict[str, dict] = {"other": {}}
    for role in ("other", "kvserve") if other_first else ("kvserve", "other"):
        if role == "other" and args.other_cmd:
            results["other"] = serve_and_bench(other_server(args), args, tokenizer, w2_rate)
            if w2_rate is None and "w2" in args.workloads and "W1" in results["other"]:
                w2_rate = 0.7 * results["other"]["W1"]["request_throughput"]
        elif role == "kvserve":
            port = free_port()
            server = Server("kvserve", kvserve_command(port, args.kvserve_args), port, args.out)
            results["kvserve"] = serve_and_bench(server, args, tokenizer, w2_rate)
    return results


def other_server(args: argparse.Namespace) -> Server:
    """The other server's command line on a free port."""
    port = free_port()
    command = args.other_cmd.format(port=port, model=EMBEDDED_NAME)
    return Server(args.other_name, command, port, args.out)


def other_w2(args: argparse.Namespace, tokenizer: Any, rate: float) -> dict:
    with other_server(args) as again:
        return run_bench(again, "W2", w2(args), tokenizer, rate, sampling(args))


def bound_measurements(report: dict[str, Any], name: str) -> list[float]:
    """One field of linear_bound.py's report, from each of the run's bound measurements."""
    return [report[key][name] for key in ("bound", "bound_after") if key in report]


def bound_lines(report: dict[str, Any]) -> tuple[float, list[str]]:
    """The bound the multiples divide by (the mean of its measurements) and its report."""
    seconds = bound_measurements(report, "w1_seconds")
    bound = sum(seconds) / len(seconds)
    if len(seconds) == 1:
        return bound, [f"bound: W1's linear layers alone take {bound:.1f} s"]
    return bound, [f"bound: W1's linear layers alone take {seconds[0]:.1f} s before the "
                   f"offline run and {seconds[1]:.1f} s after it; multiples of their mean, "
                   f"{bound:.1f} s"]  # fmt: skip


def kv_read_floor(report: dict[str, Any]) -> float:
    """Seconds W1's decode steps need to read their K and V at the streaming rate (the mean
    of the bound's measurements)."""
    seconds = bound_measurements(report, "w1_kv_read_seconds")
    return sum(seconds) / len(seconds)


def summarize(report: dict[str, Any], args: argparse.Namespace) -> None:
    lines = bound_summary(report) if "bound" in report else []
    rounds = [r for r in report["rounds"] if r["other"]]
    for index, results in enumerate(rounds):
        lines += ["", f"round {index + 1}:", *ratios(results["kvserve"], results["other"],
                                                      args.other_name)]  # fmt: skip
    if len(rounds) > 1:
        lines += ["", f"geometric mean of the {len(rounds)} rounds' ratios:",
                  *mean_ratios(rounds, args.other_name)]  # fmt: skip
    text = "\n".join(lines)
    print("\n" + text, flush=True)
    (args.out / "summary.md").write_text(text + "\n")


def bound_summary(report: dict[str, Any]) -> list[str]:
    """W1's bound, its K/V floor, and the offline and served W1 as multiples of them."""
    bound, lines = bound_lines(report)
    floor = kv_read_floor(report)
    lowest = (bound + floor) / bound
    lines.append(f"K/V reads of W1's decode steps at the streaming rate: {floor:.1f} s; no W1 "
                 f"runs under the bound + them, {lowest:.2f}x the bound")  # fmt: skip
    if "offline" in report:
        offline = report["offline"]["w1_seconds"]
        lines.append(f"offline kvserve W1: {offline:.1f} s = {offline / bound:.2f}x the bound, "
                     f"{offline / (bound + floor):.2f}x the bound + K/V reads")  # fmt: skip
        lines.append("profile breakdown (share of the offline profile's wall time):")
        for name, share in report["offline"]["breakdown"].items():
            lines.append(f"  {name:24s} {100 * share:5.1f}%")
    if "W1" not in report["kvserve"]:
        return lines
    served = report["kvserve"]["W1"]["duration"]
    lines.append(f"served kvserve W1: {served:.1f} s = {served / bound:.2f}x the bound")
    if "offline" in report:
        http = max(0.0, served - report["offline"]["w1_seconds"]) / served
        lines.append(
            f"  HTTP, tokenizer threads and streaming (served - offline): {100 * http:.1f}%"
        )
    return lines


if __name__ == "__main__":
    sys.exit(main())
