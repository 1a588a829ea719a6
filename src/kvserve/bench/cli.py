"""`kvserve bench serve`: flags generated from BenchConfig and DatasetConfig (one field, one
flag, one help text), then run, print the table, save the JSON and draw the plot."""

from __future__ import annotations

import argparse
import math

from kvserve.bench.config import BenchConfig, DatasetConfig
from kvserve.errors import UserInputError
from kvserve.flags import add_fields, from_args


def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    """`kvserve bench` with its subcommands; each sets func(args) -> exit code."""
    bench = subparsers.add_parser("bench", help="Benchmark a running server.")
    commands = bench.add_subparsers(dest="bench_command", required=True)
    serve = commands.add_parser(
        "serve",
        help="Load-test an OpenAI-compatible server: TTFT, TPOT, ITL, throughput, goodput "
        "and the KV-usage timeline from /metrics.",
    )
    add_fields(serve.add_argument_group("dataset"), DatasetConfig)
    add_fields(serve.add_argument_group("benchmark"), BenchConfig)
    serve.set_defaults(func=cmd_bench_serve)


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """ValueError (naming the flag) for bad values."""
    return from_args(BenchConfig, args, dataset=from_args(DatasetConfig, args))


def cmd_bench_serve(args: argparse.Namespace) -> int:
    _require_bench_extra()
    from kvserve.bench.plot import plot_timeline
    from kvserve.bench.report import format_table, save_json, to_json
    from kvserve.bench.runner import bench_serve

    config = config_from_args(args)
    rate = "inf" if math.isinf(config.request_rate) else f"{config.request_rate:g}"
    data = config.dataset
    what = f"{data.num_prompts} {data.dataset_name} requests to {config.api_url} at {rate} req/s"
    if data.dataset_name == "multi-turn":
        what = (f"{data.num_prompts} conversations x {data.num_turns} turns to {config.api_url}, "
                f"{config.max_concurrency or data.num_prompts} at a time")  # fmt: skip
    print(f"kvserve bench serve: {what}", flush=True)
    result = bench_serve(config)
    print(format_table(result), flush=True)
    if config.save_result:
        print(f"result saved to {save_json(result)}")
    if config.plot:
        print(f"timeline drawn into {plot_timeline(to_json(result), config.plot)}")
    failed = [r.error for r in result.records if not r.success]
    if failed:
        print(f"{len(failed)} requests failed; first error: {failed[0]}")
    return 0 if result.metrics.completed > 0 else 1


def _require_bench_extra() -> None:
    """The load generator's libraries are an extra: say how to get them, in one line."""
    import importlib.util

    missing = [m for m in ("aiohttp", "tqdm", "matplotlib") if importlib.util.find_spec(m) is None]
    if missing:
        raise UserInputError(
            f"kvserve bench needs {', '.join(missing)}: pip install 'kvserve[bench]'"
        )
