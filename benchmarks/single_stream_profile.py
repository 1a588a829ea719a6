"""Where a one-row decode step's time goes while `kvserve serve` answers one request at a
time: py-spy samples the server's threads while the single-stream client runs.

    .venv/bin/python benchmarks/single_stream_profile.py --num-prompts 8

py-spy (`pip install py-spy`; it needs ptrace, which root has) records the server's threads
into collapsed stacks: by default --nonblocking (the server runs on between samples) and only
samples of threads on a CPU (a thread waiting for the GIL or for work is not counted); with
--native the C frames too, idle samples included, at the cost of pausing the server for
each sample (a step several times slower).
Each sample of the engine thread (`kvserve-engine`) goes to the first category whose marker
is one of its frames (CATEGORIES, in order); the event-loop thread (MainThread) counts as
busy unless its innermost frames are the poller's wait.  Every count becomes milliseconds per
output token: samples / rate / output tokens.  The prefill steps are in the totals (attention
shows them apart: "attention, prefill"); with 256 prompt tokens and 128 output tokens they are
a few percent of the engine's busy time.  py-spy runs on the same two CPUs, so the client's
TPOT under it is printed beside the split (compare with single_stream.py's, unprofiled).
"""

from __future__ import annotations

import argparse
import collections
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvserve.bench.config import BenchConfig, DatasetConfig
from kvserve.bench.launcher import free_port, serve_command, start_server
from kvserve.bench.report import to_json
from kvserve.bench.runner import bench_serve
from kvserve.models.paths import EMBEDDED_NAME, embedded_model_path
from kvserve.tokenizer import load_tokenizer

# (category, frame markers): a sample belongs to the first category one of whose markers
# occurs in one of its frames.  Order matters: the LM head and attention run inside the
# step, the projections inside the compiled layer code.
CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    ("LM head", ("compute_logits",)),
    ("attention, prefill", ("_prefills",)),
    ("attention, decode", ("CpuPagedBackend", "kvserve/attention/")),
    (
        "projections (sgemm/sgemv; --native only)",
        ("sgemv", "sgemm", "mm_out", "at::native::linear"),
    ),
    (
        "layer code outside attention (norms, RoPE, SiLU; projections without --native)",
        ("between_attentions", "LlamaForCausalLM.forward", "native_layers"),
    ),  # fmt: skip
    ("sampling", ("kvserve/runner/sampling.py", "_sampling_batch", "ModelRunner._logprobs")),
    ("batch building", ("build_batch_input", "build_attention_metadata", "_decode_plan")),
    ("scheduling", ("Scheduler.schedule",)),
    ("scheduler update", ("update_from_output",)),
    ("detokenization, outputs", ("output_processor", "process_outputs")),
    ("runner/executor other", ("ModelRunner", "Worker.execute", "UniProcExecutor")),
    ("hand-over to the event loop", ("call_soon_threadsafe", "_Stream.put")),
    ("engine step other", ("AsyncLLM._step", "LLMEngine.step")),
]
POLLER_WAIT = ("epoll_wait", "uv__io_poll", "select.epoll.poll", "selectors.py")


def categorize(frames: list[str]) -> str:
    """The sample's category; outside a step the thread waits for work or runs a command
    (adding a request)."""
    if not any("AsyncLLM._step" in frame for frame in frames):
        in_command = any("_run_commands" in frame for frame in frames)
        return "commands (add a request)" if in_command else "idle (no request)"
    for name, markers in CATEGORIES:
        if any(marker in frame for frame in frames for marker in markers):
            return name
    return "engine other"


def split(stacks: Path) -> tuple[collections.Counter[str], int, int]:
    """(engine thread samples by category, event-loop busy samples, event-loop samples)
    from py-spy's raw (collapsed) output: `thread (TID): NAME;frame;frame... COUNT`."""
    engine: collections.Counter[str] = collections.Counter()
    loop_busy = loop_all = 0
    for line in stacks.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        frames, count = stack.split(";"), int(count_text)
        if "kvserve-engine" in frames[0]:
            engine[categorize(frames[1:])] += count
        elif "MainThread" in frames[0]:
            loop_all += count
            if not any(w in frame for frame in frames[-4:] for w in POLLER_WAIT):
                loop_busy += count
    return engine, loop_busy, loop_all


def report(engine: collections.Counter[str], loop_busy: int, rate: int, tokens: int) -> None:
    """Milliseconds per output token by category (engine thread), busy ones summed."""
    per_token = 1000.0 / rate / tokens
    busy = {name: n for name, n in engine.items() if not name.startswith("idle")}
    total = sum(busy.values())
    print("| engine thread | ms / output token | share of busy |\n|---|---:|---:|")
    for name, n in sorted(busy.items(), key=lambda item: -item[1]):
        print(f"| {name} | {n * per_token:.2f} | {100 * n / total:.1f}% |")
    print(f"| **busy in all** | **{total * per_token:.2f}** | 100% |")
    print(f"| idle (no request) | {engine['idle (no request)'] * per_token:.2f} | - |")
    print(f"| event loop thread busy (HTTP, streaming) | {loop_busy * per_token:.2f} | - |")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kvserve-args", default="--kv-cache-memory 256MiB --max-model-len 4096")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rate", type=int, default=100, help="py-spy samples per second.")
    parser.add_argument("--out", default="results/single_stream_profile")
    parser.add_argument(
        "--native",
        action="store_true",
        help="C frames too (and idle samples), pausing the server at each sample: slows a "
        "step several-fold; without it only on-CPU samples, not pausing the server.",
    )
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(py_spy).is_file():
        sys.exit("py-spy not found: pip install py-spy")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    flags = ["--disable-uvicorn-access-log", *shlex.split(args.kvserve_args)]
    server = start_server(serve_command(port, flags), port, out)
    try:
        server.wait_healthy(600.0)
        stacks = out / "stacks.txt"
        command = [py_spy, "record", "--pid", str(server.process.pid), "--rate", str(args.rate),
                   "--format", "raw", "--threads",
                   *(["--idle", "--native"] if args.native else ["--nonblocking"]),
                   "-o", str(stacks)]  # fmt: skip
        log = (out / "py-spy.log").open("w")
        recorder = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        time.sleep(2.0)  # py-spy attached
        dataset = DatasetConfig(num_prompts=args.num_prompts, random_input_len=args.input_len,
                                random_output_len=args.output_len)  # fmt: skip
        config = BenchConfig(base_url=server.base_url, model=EMBEDDED_NAME, ignore_eos=True,
                             dataset=dataset, max_concurrency=1, disable_tqdm=True)  # fmt: skip
        doc = to_json(bench_serve(config, tokenizer=load_tokenizer(embedded_model_path())))
        recorder.send_signal(signal.SIGINT)
        recorder.wait(60)
    finally:
        server.stop()
    engine, loop_busy, _ = split(stacks)
    ttft, tpot = doc["median_ttft_ms"], doc["median_tpot_ms"]
    print(f"client under py-spy: TTFT p50 {ttft:.1f} ms, TPOT p50 {tpot:.2f} ms, "
          f"{doc['total_output_tokens']} output tokens")  # fmt: skip
    report(engine, loop_busy, args.rate, doc["total_output_tokens"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
