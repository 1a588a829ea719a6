"""Decode attention: the C paged kernel (cpu-paged) against the PyTorch reference (torch), on
one layer of the embedded model's shape, for every KV cache dtype.  Both run in this process,
on the same cache and block tables; the ratio is what to read.

    OMP_NUM_THREADS=1 taskset -c 1 .venv/bin/python benchmarks/attention_decode.py \\
        --batch 45 --context 340
"""

from __future__ import annotations

import argparse
import time

import torch

from kvserve.attention import select_backend
from kvserve.attention.base import AttentionMetadata
from kvserve.kv import quant
from kvserve.kv.spec import kv_cache_spec
from kvserve.runner.kv_storage import allocate_kv_caches

KV_DTYPES = ("auto", "bfloat16", "float16", "int8", "fp8_e4m3", "fp8_e5m2")


def make_layer(kv_dtype: str, args: argparse.Namespace):
    """One layer's cache of --num-blocks blocks, every slot written through the real path."""
    model_dtype = kv_dtype if kv_dtype in ("bfloat16", "float16") else "float32"
    cache_dtype = kv_dtype if kv_dtype in quant.QUANTIZED_DTYPES else "auto"
    spec = kv_cache_spec(1, args.kv_heads, args.head_dim, cache_dtype, model_dtype, args.block_size)
    layer = allocate_kv_caches(spec, args.num_blocks, torch.device("cpu"))[0]
    slots = torch.arange(args.num_blocks * args.block_size)
    shape = (len(slots), args.kv_heads, args.head_dim)
    layer.write(slots, torch.randn(shape), torch.randn(shape))
    return layer


def scattered_metadata(args: argparse.Namespace) -> AttentionMetadata:
    """--batch sequences of --context tokens on random, distinct blocks (as after many
    allocations and frees)."""
    per_seq = -(-args.context // args.block_size)
    if per_seq * args.batch > args.num_blocks:
        raise SystemExit("--num-blocks too small for --batch x --context")
    blocks = torch.randperm(args.num_blocks)[: per_seq * args.batch].view(args.batch, per_seq)
    lens = torch.full((args.batch,), args.context)
    return AttentionMetadata(torch.zeros(0, dtype=torch.long), args.batch, blocks, lens, ())


def seconds_per_call(fn, repeats: int) -> float:
    fn()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - started) / repeats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=45)
    p.add_argument("--context", type=int, default=340)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=1456, help="512 MiB of float32 / 30 layers")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    cpu = torch.device("cpu")
    reference, paged = select_backend("torch", cpu), select_backend("cpu-paged", cpu)
    md = scattered_metadata(args)
    query = torch.randn(args.batch, args.heads, args.head_dim)
    scale = args.head_dim**-0.5
    print(f"batch {args.batch} x {args.context} tokens, {args.heads} heads / {args.kv_heads} KV "
          f"heads x {args.head_dim}, {torch.get_num_threads()} thread(s)")  # fmt: skip
    print("| KV dtype | torch (ms) | cpu-paged (ms) | speed-up | max abs diff |")
    print("|---|---:|---:|---:|---:|")
    for kv_dtype in KV_DTYPES:
        layer = make_layer(kv_dtype, args)
        expected = reference._decode(query, layer, md, scale)
        diff = (paged._decode(query, layer, md, scale) - expected).abs().max().item()
        ref_s = seconds_per_call(
            lambda layer=layer: reference._decode(query, layer, md, scale), args.repeats
        )
        new_s = seconds_per_call(
            lambda layer=layer: paged._decode(query, layer, md, scale), args.repeats
        )
        print(f"| {kv_dtype} | {ref_s * 1e3:.2f} | {new_s * 1e3:.2f} | {ref_s / new_s:.1f}x "
              f"| {diff:.1e} |")  # fmt: skip


if __name__ == "__main__":
    main()
