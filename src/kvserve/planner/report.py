"""Render a Plan: a readable table, JSON, and a memory-vs-context plot."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from kvserve.config import format_bytes
from kvserve.planner.layers import kv_layout
from kvserve.planner.model import ModelShape
from kvserve.planner.plan import DtypePlan, Plan

_COLUMNS = ("kv dtype", "bytes/token", "per sequence", "batch", "blocks", "max seqs",
            "max context")  # fmt: skip


def format_plan(plan: Plan) -> str:
    """The human answer: the model, the formula, the budget, then one row per KV dtype."""
    chosen = plan.selected
    lines = [*_header(plan), ""]
    lines.append(
        f"KV per sequence at {plan.context_len:,} tokens, {_dtype_label(chosen)}: "
        f"{chosen.bytes_per_sequence:,} bytes ({format_bytes(chosen.bytes_per_sequence)}); "
        f"batch of {plan.batch_size}: {format_bytes(chosen.bytes_for_batch)}"
    )
    lines.append(
        f"in whole blocks of {plan.block_size}, as the engine allocates and logs it: "
        f"{chosen.block_bytes_per_sequence:,} bytes per sequence"
    )
    lines.append(_verdict(plan, chosen))
    lines += ["", *_table(plan), ""]
    lines += [f"note: {note}" for note in plan.notes]
    return "\n".join(lines)


def _header(plan: Plan) -> list[str]:
    tp = plan.tensor_parallel_size
    params = f"{plan.num_params / 1e9:,.2f}B params" + ("" if plan.params_exact else " (est.)")
    per_gpu = f", {format_bytes(plan.weight_bytes_per_gpu)} per GPU (TP {tp})" if tp > 1 else ""
    rows = [
        ("model", f"{plan.model_name} [{plan.architecture}, {plan.attention}]"),
        ("source", plan.source),
        ("KV formula", plan.selected.formula[0]),
        *(("", line) for line in plan.selected.formula[1:]),
        ("weights", f"{params} x {plan.weight_dtype} = "
                    f"{format_bytes(plan.weight_bytes)}{per_gpu}"),
        ("memory", f"{plan.gpu_name}: {format_bytes(plan.gpu_memory)} x "
                   f"{plan.gpu_memory_utilization:g} = {format_bytes(plan.usable_memory)}"
                   + (" per GPU" if tp > 1 else "")),
        ("KV budget", f"{format_bytes(plan.usable_memory)} - "
                      f"{format_bytes(plan.weight_bytes_per_gpu)} weights = "
                      f"{format_bytes(plan.kv_budget)}"
                      + (" per GPU" if tp > 1 else "")),
        ("request", f"context {plan.context_len:,} tokens, batch {plan.batch_size}, "
                    f"block size {plan.block_size}"),
    ]  # fmt: skip
    return [f"{label:<11} {text}".rstrip() for label, text in rows]


def _verdict(plan: Plan, chosen: DtypePlan) -> str:
    if plan.kv_budget <= 0:
        return "does not fit: no memory is left for the KV cache"
    fits = "fits" if chosen.batch_fits else "does NOT fit"
    return (
        f"batch of {plan.batch_size} {fits}: at most {chosen.max_num_seqs:,} sequences of "
        f"{plan.context_len:,} tokens at once"
    )


def _table(plan: Plan) -> list[str]:
    rows = [_COLUMNS] + [_row(plan, d) for d in plan.dtypes]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    out = []
    for row in rows:
        rest = [cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True)]
        cells = [row[0].ljust(widths[0]), *rest]
        out.append("  ".join(cells))
    return out


def _row(plan: Plan, d: DtypePlan) -> tuple[str, ...]:
    marker = "*" if d.kv_cache_dtype == plan.kv_cache_dtype else " "
    max_len = "no limit" if d.max_model_len is None else f"{d.max_model_len:,}"
    return (
        f"{marker} {_dtype_label(d)}",
        f"{d.bytes_per_token:,}",
        format_bytes(d.bytes_per_sequence),
        format_bytes(d.bytes_for_batch),
        f"{d.num_blocks:,}",
        f"{d.max_num_seqs:,}",
        max_len,
    )


def _dtype_label(d: DtypePlan) -> str:
    if d.kv_cache_dtype == "auto":
        return f"auto ({d.storage_dtype})"
    return d.kv_cache_dtype


def plan_to_json(plan: Plan) -> str:
    """Every number of the plan, exact bytes, for scripts."""
    data = dataclasses.asdict(plan)
    data["selected"] = plan.kv_cache_dtype
    return json.dumps(data, indent=2)


def seq_counts_to_draw(batch_size: int, max_curves: int = 8) -> list[int]:
    """1..N sequences, thinned to at most ``max_curves`` evenly spread counts (1 and N kept)."""
    if batch_size <= max_curves:
        return list(range(1, batch_size + 1))
    step = (batch_size - 1) / (max_curves - 1)
    return sorted({round(1 + i * step) for i in range(max_curves)})


def plot_plan(plan: Plan, shape: ModelShape, path: Path) -> None:
    """KV memory per GPU against context length for 1..N sequences, one panel per KV dtype.

    The dashed line is the KV budget: where a curve crosses it, that many sequences of that
    length no longer fit.  Raises OSError/ValueError when the file cannot be written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = [max(1, round(plan.context_len * i / 200)) for i in range(201)]
    counts = seq_counts_to_draw(plan.batch_size)
    columns = -(-len(plan.dtypes) // 2)
    fig, axes = plt.subplots(
        2, columns, figsize=(5.5 * columns, 8), sharex=True, sharey=True, squeeze=False
    )
    for ax in list(axes.flat)[len(plan.dtypes) :]:
        ax.set_visible(False)  # an odd number of dtypes leaves one panel empty
    for ax, d in zip(axes.flat, plan.dtypes, strict=False):
        layout = kv_layout(shape, d.kv_cache_dtype, plan.block_size, plan.tensor_parallel_size)
        per_seq = [layout.bytes_per_sequence(n) / 2**30 for n in contexts]
        for count in counts:
            ax.plot(contexts, [count * b for b in per_seq], label=f"{count} seq")
        ax.axhline(max(0, plan.kv_budget) / 2**30, color="black", linestyle="--", label="KV budget")
        ax.set_title(f"{_dtype_label(d)}: max {d.max_num_seqs:,} seqs at {plan.context_len:,}")
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("KV memory per GPU (GiB)")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize="small", ncol=math.ceil(len(counts) / 5))
    fig.suptitle(
        f"{plan.model_name} on {plan.gpu_name} (TP {plan.tensor_parallel_size}, "
        f"utilization {plan.gpu_memory_utilization:g})"
    )
    fig.tight_layout()
    try:
        fig.savefig(path)
    finally:
        plt.close(fig)
