"""The C kernels of two revisions side by side in one process: the working tree's
`src/kvserve/native/csrc` against the same directory at a git revision (--base, one with this
layout and the same argument structures), each built into a library of its own and called
through native/ops.py's wrappers, timed alternately (the machine's speed drifts by more than
most kernel changes are worth, so only an alternating comparison in one process can show
them).

    .venv/bin/python benchmarks/kernel_ab.py projections --rows 128   # a decode step's 120
    .venv/bin/python benchmarks/kernel_ab.py decode --batch 64 --context 48 --base HEAD~1
    .venv/bin/python benchmarks/kernel_ab.py prefill --queries 1024 --keys 1024

projections: the projection kernel (csrc/linear/linear_amx.c on AMX, linear_dot.c on
AVX512-BF16 without it) over the embedded model's four projection shapes, 30 layers of random
weights, --rows rows. decode: the paged decode kernel at --batch x --context tokens, sequences
on consecutive blocks, --kv-dtype rows (float32 queries for 8- and 4-bit ones), cycling 30
layer caches (so that a layer's K/V has left the caches when it is read again). prefill: the
bf16 prefill kernel, --queries over --keys keys of one sequence (causal with --causal). Prints
the median and minimum of --rounds rounds.
"""

from __future__ import annotations

import argparse
import ctypes
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvserve.attention.base import AttentionMetadata
from kvserve.attention.cpu_paged import CpuPagedBackend
from kvserve.attention.kv_cache import allocate_kv_caches
from kvserve.kv.spec import kv_cache_spec
from kvserve.models.packed_linear import PackedLinear
from kvserve.native import build, ops

REPO = build.CSRC.parents[3]
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down
LAYERS = 30


def build_library(root: Path, output: Path) -> ops.Kernels:
    """The library from the sources under root (a csrc directory), with the engine's own
    flags, its entry points declared by ops.py."""
    sources = sorted(root.glob("*/*.c"))
    compiler = shutil.which("gcc") or "cc"
    command = build.compile_command(compiler, root, sources, output)
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr}")
    return ops.Kernels(ctypes.CDLL(str(output)))


def base_library(revision: str, workdir: Path) -> ops.Kernels:
    """The library as `revision` had it (every file of its csrc directory)."""
    source_dir = workdir / "base"
    csrc = build.CSRC.relative_to(REPO).as_posix()
    listed = subprocess.run(["git", "-C", str(REPO), "ls-tree", "-r", "--name-only", revision,
                             csrc], capture_output=True, text=True, check=True)  # fmt: skip
    if not listed.stdout.strip():
        raise SystemExit(f"{revision} has no {csrc}: --base must be a revision of this layout")
    for relative in listed.stdout.split():
        shown = subprocess.run(["git", "-C", str(REPO), "show", f"{revision}:{relative}"],
                               capture_output=True, check=True)  # fmt: skip
        target = source_dir / Path(relative).relative_to(csrc)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(shown.stdout)
    return build_library(source_dir, workdir / "base.so")


def projections(kernels: ops.Kernels, args: argparse.Namespace) -> Callable[[], None]:
    weights = [PackedLinear((torch.randn(n, k) * 0.05).to(torch.bfloat16), None)
               for _ in range(LAYERS) for n, k in SHAPES]  # fmt: skip
    inputs = {k: torch.randn(args.rows, k).to(torch.bfloat16) for _, k in SHAPES}
    outputs = {n: torch.empty(args.rows, n, dtype=torch.bfloat16) for n, _ in SHAPES}
    calls = [(inputs[w.in_features], w.packed_weight, outputs[w.out_features]) for w in weights]

    def run() -> None:
        for x, weight, out in calls:
            kernels.linear_packed(x, weight, None, out)

    return run


def decode(kernels: ops.Kernels, args: argparse.Namespace) -> Callable[[], None]:
    backend = CpuPagedBackend()
    backend._kernels = kernels
    per_seq = -(-args.context // 16)
    spec = kv_cache_spec(LAYERS, 3, 64, args.kv_dtype, "bfloat16", 16)
    caches = allocate_kv_caches(spec, args.batch * per_seq, torch.device("cpu"))
    slots = torch.arange(args.batch * per_seq * 16)
    for cache in caches:  # random rows, through the dtype's own write path
        cache.write(slots, torch.randn(len(slots), 3, 64), torch.randn(len(slots), 3, 64))
    tables = torch.arange(args.batch * per_seq).view(args.batch, per_seq)
    lens = torch.full((args.batch,), args.context)
    metadata = AttentionMetadata(torch.zeros(0, dtype=torch.long), args.batch, tables, lens, ())
    # bf16 queries for a bf16 cache (a bf16 model's), float32 ones for 8- and 4-bit caches
    query_dtype = torch.bfloat16 if args.kv_dtype in ("auto", "bfloat16") else torch.float32
    query = torch.randn(args.batch, 9, 64).to(query_dtype)

    def run() -> None:
        for cache in caches:
            backend._decode(query, cache, metadata, 0.125)

    return run


def prefill(kernels: ops.Kernels, args: argparse.Namespace) -> Callable[[], None]:
    query = torch.randn(1, args.queries, 9, 64).to(torch.bfloat16)
    keys, values = (torch.randn(1, args.keys, 3, 64).to(torch.bfloat16) for _ in range(2))

    def run() -> None:
        for _ in range(10):  # as bf16_prefill.attend_batch(..., with_lse=True) calls it
            out = torch.empty(query.shape, dtype=torch.float32)
            lse = torch.empty(query.shape[:3], dtype=torch.float32)
            kernels.prefill_attention(query, keys, values, args.keys, args.causal, 0.125, out,
                                      lse)  # fmt: skip

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["projections", "decode", "prefill"])
    parser.add_argument("--base", default="HEAD", help="git revision to compare against")
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--context", type=int, default=320)
    parser.add_argument("--queries", type=int, default=1024)
    parser.add_argument("--keys", type=int, default=1024)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--kv-dtype", default="bfloat16", help="decode: the cache's dtype")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    setup = {"projections": projections, "decode": decode, "prefill": prefill}[args.what]
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        libraries = {args.base: base_library(args.base, workdir),
                     "working tree": build_library(build.CSRC, workdir / "tree.so")}  # fmt: skip
        runs = {name: setup(lib, args) for name, lib in libraries.items()}
        times: dict[str, list[float]] = {name: [] for name in runs}
        for run in runs.values():
            run()  # warm up
        for _ in range(args.rounds):
            for name, run in runs.items():
                started = time.perf_counter()
                run()
                times[name].append((time.perf_counter() - started) * 1e3)
    for name, values in times.items():
        print(f"{name}: median {statistics.median(values):.3f} ms, min {min(values):.3f} ms")


if __name__ == "__main__":
    main()
