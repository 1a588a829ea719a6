"""`kvserve plan`: the argparse front of the planner.

The lead's ``kvserve.cli`` calls ``add_plan_parser`` on its subparsers; the subcommand then
runs ``run_plan``, which returns the exit code: 0, or 2 with one ``kvserve plan: error: ...``
line on stderr for bad input (never a traceback).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvserve.config import KV_CACHE_DTYPES, parse_size
from kvserve.planner.gpus import DEFAULT_GPU, GPU, find_gpu, gpu_names
from kvserve.planner.model import PlanError
from kvserve.planner.plan import PlanInputs, make_plan
from kvserve.planner.presets import preset_names
from kvserve.planner.readers import load_model_shape
from kvserve.planner.report import format_plan, plan_to_json, plot_plan
from kvserve.planner.weights import WEIGHT_DTYPE_BITS


def add_plan_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add the `plan` subcommand, with ``func=run_plan``."""
    parser = subparsers.add_parser(
        "plan",
        help="KV-cache capacity plan: bytes per token, per sequence, max concurrent sequences.",
        description="Plan KV-cache memory for a model on a GPU before deploying it.",
        epilog=f"presets: {', '.join(preset_names())}. GPUs: {', '.join(gpu_names())}.",
    )
    parser.add_argument(
        "model",
        metavar="MODEL|PRESET",
        help="GGUF file, Hugging Face directory, config.json, or a preset name.",
    )
    parser.add_argument(
        "--context",
        metavar="N",
        type=int,
        default=None,
        help="Tokens per sequence (default: the model's max_position_embeddings).",
    )
    parser.add_argument(
        "--batch",
        metavar="N",
        type=int,
        default=1,
        help="Concurrent sequences to check (and curves to plot).",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--gpu", metavar="NAME", default=None, help=f"GPU preset (default {DEFAULT_GPU})."
    )
    where.add_argument(
        "--memory",
        metavar="SIZE",
        default=None,
        help="Memory per GPU instead of a preset, e.g. 80GiB or 24GB.",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        metavar="F",
        type=float,
        default=0.9,
        help="Fraction of GPU memory for weights + KV cache (default 0.9).",
    )
    parser.add_argument(
        "--kv-cache-memory",
        metavar="SIZE",
        default=None,
        help="KV budget given directly, as `kvserve serve --kv-cache-memory` (skips GPU math).",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="KV dtype to highlight; all are shown side by side.",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", *WEIGHT_DTYPE_BITS),
        help="Weight dtype (default: the checkpoint's).",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        metavar="N",
        type=int,
        default=1,
        help="Tensor-parallel ranks; numbers are per GPU.",
    )
    parser.add_argument(
        "--block-size", metavar="N", type=int, default=16, help="Tokens per KV block."
    )
    parser.add_argument("--json", action="store_true", help="Print the plan as JSON.")
    parser.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="FILE.png",
        help="Draw KV memory against context length for 1..batch sequences.",
    )
    parser.set_defaults(func=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    """Print the plan (and draw it); 2 with one error line on bad input."""
    try:
        shape = load_model_shape(args.model)
        gpu = _gpu(args.gpu, args.memory)
        inputs = PlanInputs(
            gpu_name=gpu.name, gpu_memory=gpu.memory_bytes, context_len=args.context,
            batch_size=args.batch, gpu_memory_utilization=args.gpu_memory_utilization,
            kv_cache_dtype=args.kv_cache_dtype, tensor_parallel_size=args.tensor_parallel_size,
            block_size=args.block_size, weight_dtype=args.dtype,
            kv_cache_memory=_optional_size(args.kv_cache_memory),
        )  # fmt: skip
        plan = make_plan(shape, inputs)
        if args.plot is not None:
            plot_plan(plan, shape, args.plot)
    except (PlanError, ValueError, OSError) as exc:
        print(f"kvserve plan: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    print(plan_to_json(plan) if args.json else format_plan(plan))
    if args.plot is not None and not args.json:
        print(f"plot written to {args.plot}")
    return 0


def _optional_size(text: str | None) -> int | None:
    return None if text is None else parse_size(text)


def _gpu(name: str | None, memory: str | None) -> GPU:
    """--gpu NAME or --memory SIZE (mutually exclusive) -> the memory of one rank."""
    if memory is None:
        return find_gpu(name or DEFAULT_GPU)
    try:
        size = parse_size(memory)
    except ValueError as exc:
        raise PlanError(f"--memory: {exc}") from None
    if size <= 0:
        raise PlanError(f"--memory must be positive, e.g. 80GiB (got {memory!r})")
    return GPU(f"{memory} device", size)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
