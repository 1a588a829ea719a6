"""`kvserve plan`: the argparse front of the planner.

The lead's ``kvserve.cli`` calls ``add_plan_parser`` on its subparsers; the subcommand then
runs ``run_plan``, which returns the exit code: 0, or 2 with one ``kvserve plan: error: ...``
line on stderr for bad input (never a traceback).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvserve.config import GPU_MEMORY_UTILIZATION_DEFAULT, CacheConfig, LoadConfig, parse_size
from kvserve.flags import add_fields, from_args
from kvserve.planner.gpus import DEFAULT_GPU, GPU, find_gpu, gpu_names
from kvserve.planner.model import PlanError
from kvserve.planner.plan import PlanInputs, make_plan
from kvserve.planner.presets import preset_names
from kvserve.planner.readers import load_model_shape
from kvserve.planner.report import format_plan, plan_to_json, plot_plan
from kvserve.planner.weights import WEIGHT_DTYPE_BITS


def _help(text: str, **extra: Any) -> dict[str, Any]:
    return {"help": text, **extra}


@dataclass(frozen=True)
class PlanOptions:
    """`kvserve plan`'s own flags; the KV flags it shares with `kvserve serve` come from the
    engine's CacheConfig and LoadConfig fields."""

    context: int | None = field(
        default=None,
        metadata=_help(
            "Tokens per sequence (default: the model's max_position_embeddings).", metavar="N"
        ),
    )
    batch: int = field(
        default=1,
        metadata=_help("Concurrent sequences to check (and curves to plot).", metavar="N"),
    )
    gpu: str | None = field(
        default=None, metadata=_help(f"GPU preset (default {DEFAULT_GPU}).", metavar="NAME")
    )
    memory: str | None = field(
        default=None,
        metadata=_help("Memory per GPU instead of a preset, e.g. 80GiB or 24GB.", metavar="SIZE"),
    )
    dtype: str = field(
        default="auto",
        metadata=_help(
            "Weight dtype (default: the checkpoint's).", choices=("auto", *WEIGHT_DTYPE_BITS)
        ),
    )
    json: bool = field(default=False, metadata=_help("Print the plan as JSON."))
    plot: str | None = field(
        default=None,
        metadata=_help(
            "Draw KV memory against context length for 1..batch sequences.", metavar="FILE.png"
        ),
    )


SHARED_CACHE_FLAGS = ("block_size", "kv_cache_dtype", "kv_cache_memory", "gpu_memory_utilization")


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
    add_fields(parser, PlanOptions, skip=("gpu", "memory"))
    add_fields(parser.add_mutually_exclusive_group(), PlanOptions, only=("gpu", "memory"))
    group = parser.add_argument_group("shared with kvserve serve")
    add_fields(group, CacheConfig, only=SHARED_CACHE_FLAGS)
    add_fields(group, LoadConfig, only=("tensor_parallel_size",))
    parser.set_defaults(func=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    """Print the plan (and draw it); 2 with one error line on bad input."""
    try:
        options = from_args(PlanOptions, args)
        cache = from_args(CacheConfig, args)  # the engine's rules and messages for these flags
        shape = load_model_shape(args.model)
        gpu = _gpu(options.gpu, options.memory)
        utilization = cache.gpu_memory_utilization
        inputs = PlanInputs(
            gpu_name=gpu.name, gpu_memory=gpu.memory_bytes, context_len=options.context,
            batch_size=options.batch, kv_cache_dtype=cache.kv_cache_dtype,
            gpu_memory_utilization=GPU_MEMORY_UTILIZATION_DEFAULT if utilization is None
            else utilization,
            tensor_parallel_size=args.tensor_parallel_size, block_size=cache.block_size,
            weight_dtype=options.dtype, kv_cache_memory=cache.kv_cache_memory,
        )  # fmt: skip
        plan = make_plan(shape, inputs)
        if options.plot is not None:
            plot_plan(plan, shape, Path(options.plot))
    except (PlanError, ValueError, OSError) as exc:
        print(f"kvserve plan: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    print(plan_to_json(plan) if options.json else format_plan(plan))
    if options.plot is not None and not options.json:
        print(f"plot written to {options.plot}")
    return 0


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
