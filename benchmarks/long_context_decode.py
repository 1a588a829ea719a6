"""One decode step of the embedded model at long context, for each KV cache dtype: 8
sequences x 8,192 tokens of context by default (W5's shape, docs/benchmarks.md), the whole
model (weights, attention through the cpu-paged C kernel, logits), and the attention alone (30
layers of the decode kernel).  Beside each, the streaming-read floor of its K/V bytes: what
reading every K and V byte of the step once costs at the machine's streaming rate (a torch sum
over 1 GiB).

The caches are filled with random rows through the real quantize-on-write path (what attention
costs does not depend on the values), so no 65,536-token prefill is needed.  The dtypes are
timed in turns, round after round, in one process; each gets its best round.  Read the
ratios against bfloat16 (a 16-bit cache under the float32 model, as --kv-cache-dtype bfloat16
serves it on a CPU without bf16 arithmetic).  The weights are what `kvserve serve` loads
(--weight-dtype auto: the embedded file's 4-bit blocks for these 8-row steps), so the part of
the step that is not attention is the served one.

    .venv/bin/python benchmarks/long_context_decode.py --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from linear_bound import read_bytes_per_second  # the bound's streaming rate (benchmarks/)

from kvserve.attention import select_backend
from kvserve.attention.base import AttentionMetadata
from kvserve.attention.kv_cache import kv_cache_bytes
from kvserve.evaluation.paged import allocate_cache
from kvserve.kv.spec import cdiv
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.loader import load_checkpoint
from kvserve.models.quantized_linear import q8_plan
from kvserve.native import platform
from kvserve.runner.paged_forward import Piece, forward_hidden

CPU = torch.device("cpu")
KV_DTYPES = ("bfloat16", "float32", "int8", "int4")


def _seconds(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def filled(model, kv_dtype: str, batch: int, context: int, block_size: int):
    """A cache of `batch` x `context` tokens, every slot written with random K/V rows."""
    per_seq = cdiv(context + 1, block_size)
    cache = allocate_cache(model.config, kv_dtype, torch.float32, block_size, batch * per_seq, CPU)
    heads, dim = model.config.num_kv_heads, model.config.head_dim
    slots = torch.arange(batch * per_seq * block_size)
    gen = torch.Generator().manual_seed(0)
    for layer in {id(c): c for c in cache.layers}.values():
        for first in range(0, len(slots), 8192):
            part = slots[first : first + 8192]
            layer.write(part, *(torch.randn(len(part), heads, dim, generator=gen) for _ in "kv"))
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    return cache, tables


class Subject:
    """One KV dtype's filled cache, with its step and its attention ready to time."""

    def __init__(self, model, kv_dtype: str, args: argparse.Namespace) -> None:
        self.model, self.args = model, args
        self.cache, tables = filled(model, kv_dtype, args.batch, args.context, args.block_size)
        self.backend = select_backend("cpu-paged", CPU)
        self.pieces = [Piece(str(i), [100 + i], args.context, tables[i])
                       for i in range(args.batch)]  # fmt: skip
        self.query = torch.randn(args.batch, model.config.num_heads, model.config.head_dim)
        self.metadata = AttentionMetadata(
            torch.zeros(0, dtype=torch.long), args.batch, torch.tensor(tables),
            torch.full((args.batch,), args.context + 1), (),
        )  # fmt: skip
        self.steps: list[float] = []
        self.attends: list[float] = []

    def step(self) -> None:
        """The model's decode step: every layer, attention through the C kernel, logits."""
        hidden = forward_hidden(self.model, self.cache, self.pieces, CPU, self.backend)
        self.model.compute_logits(torch.cat(hidden))

    def attention(self) -> None:
        """The decode kernel alone, over every layer's cache (rotation apart)."""
        scale = self.model.config.head_dim**-0.5
        for layer in self.cache.layers:
            self.backend._decode(self.query, layer, self.metadata, scale)

    def time_once(self) -> None:
        self.steps.append(_seconds(self.step))
        self.attends.append(_seconds(self.attention))

    def report(self, read_rate: float) -> dict:
        spec, args = self.cache.spec, self.args
        kv_bytes = args.batch * (args.context + 1) * spec.bytes_per_token
        return {
            "kv_dtype": spec.dtype,
            "bytes_per_token": spec.bytes_per_token,
            "cache_bytes": kv_cache_bytes(self.cache.layers),
            "step_ms": 1e3 * min(self.steps),
            "attention_ms": 1e3 * min(self.attends),
            "step_ms_median": 1e3 * statistics.median(self.steps),
            "attention_ms_median": 1e3 * statistics.median(self.attends),
            "kv_bytes_read": kv_bytes,
            "kv_read_floor_ms": 1e3 * kv_bytes / read_rate,
        }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=8191, help="cached tokens before the new one")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--kv-dtypes", default=",".join(KV_DTYPES))
    p.add_argument("--weight-dtype", default="auto", help="as kvserve serve's flag")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    platform.set_cpu_threads()
    checkpoint = load_checkpoint(None)
    q8 = q8_plan(args.weight_dtype, CPU, torch.float32, checkpoint.config.stored_weight_type)
    model = LlamaForCausalLM.from_weights(checkpoint.config, checkpoint.weights, torch.float32, CPU,
                                          q8)  # fmt: skip
    subjects = [Subject(model, d, args) for d in args.kv_dtypes.split(",")]
    for subject in subjects:  # warm-up
        subject.step(), subject.attention()
    # Round-robin, the best of --repeats rounds each: the machine's speed drifts within a
    # run, and one dtype timed after another would carry the drift into their ratio.
    for _ in range(args.repeats):
        for subject in subjects:
            subject.time_once()
    read_rate = read_bytes_per_second()
    rows = [subject.report(read_rate) for subject in subjects]
    base = next((r for r in rows if r["kv_dtype"] == "bfloat16"), rows[0])
    for r in rows:
        r["step_vs_bfloat16"] = r["step_ms"] / base["step_ms"]
        r["attention_vs_bfloat16"] = r["attention_ms"] / base["attention_ms"]
    report = {
        "batch": args.batch, "context": args.context + 1, "threads": torch.get_num_threads(),
        "read_gb_per_s": read_rate / 1e9, "model_dtype": "float32",
        "weight_dtype": args.weight_dtype, "results": rows,
    }  # fmt: skip
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"{args.batch} sequences x {args.context + 1:,} tokens, {report['threads']} threads, "
          f"streaming reads {report['read_gb_per_s']:.1f} GB/s; float32 model, "
          f"--weight-dtype {args.weight_dtype}")  # fmt: skip
    print("| KV dtype | bytes/token | step (ms) | vs bf16 | attention, 30 layers (ms) | vs bf16 "
          "| K/V read floor (ms) |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['kv_dtype']} | {r['bytes_per_token']:,} | {r['step_ms']:.1f} "
              f"| {r['step_vs_bfloat16']:.2f}x | {r['attention_ms']:.1f} "
              f"| {r['attention_vs_bfloat16']:.2f}x | {r['kv_read_floor_ms']:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
