"""Decode attention: the C paged kernel (cpu-paged) against the PyTorch reference (torch), on
the embedded model's shape, for every KV cache dtype.  Both run in this process, on the same
caches and block tables; the ratio is what to read.  Calls cycle through --layers layer caches
(30, as the model) so that, as in the engine, a layer's K/V has left the CPU caches by the
time it is read again: with one layer of 36 MB the last-level cache holds much of it and both
backends look faster than they run in the engine.

    OMP_NUM_THREADS=1 taskset -c 1 .venv/bin/python benchmarks/attention_decode.py \\
        --batch 45 --context 340

On a CPU with AMX, --amx-ab times the bf16 cache's two kernel paths against each other (scores
on AMX tiles, or vdpbf16ps dot products), alternating, at W1's decode shape:

    .venv/bin/python benchmarks/attention_decode.py --batch 128 --context 320 \\
        --num-blocks 2600 --amx-ab
"""

from __future__ import annotations

import argparse
import time

import torch

from kvserve import kv_quant as quant
from kvserve.attention import select_backend
from kvserve.attention.base import AttentionMetadata
from kvserve.attention.kv_cache import allocate_kv_caches
from kvserve.kv.spec import kv_cache_spec
from kvserve.native import ops

KV_DTYPES = ("auto", "bfloat16", "float16", "int8", "fp8_e4m3", "fp8_e5m2")


def make_layers(kv_dtype: str, args: argparse.Namespace):
    """--layers layer caches of --num-blocks blocks, every slot written through the real
    path."""
    model_dtype = kv_dtype if kv_dtype in ("bfloat16", "float16") else "float32"
    cache_dtype = kv_dtype if kv_dtype in quant.QUANTIZED_DTYPES else "auto"
    spec = kv_cache_spec(
        args.layers, args.kv_heads, args.head_dim, cache_dtype, model_dtype, args.block_size
    )
    layers = allocate_kv_caches(spec, args.num_blocks, torch.device("cpu"))
    slots = torch.arange(args.num_blocks * args.block_size)
    shape = (len(slots), args.kv_heads, args.head_dim)
    for layer in layers:
        layer.write(slots, torch.randn(shape), torch.randn(shape))
    return layers


def scattered_metadata(args: argparse.Namespace) -> AttentionMetadata:
    """--batch sequences of --context tokens on random, distinct blocks (as after many
    allocations and frees)."""
    per_seq = -(-args.context // args.block_size)
    if per_seq * args.batch > args.num_blocks:
        raise SystemExit("--num-blocks too small for --batch x --context")
    blocks = torch.randperm(args.num_blocks)[: per_seq * args.batch].view(args.batch, per_seq)
    lens = torch.full((args.batch,), args.context)
    return AttentionMetadata(torch.zeros(0, dtype=torch.long), args.batch, blocks, lens, ())


def seconds_per_call(fn, layers: list, repeats: int) -> float:
    """Mean seconds of fn(layer), cycling through the layers `repeats` times."""
    for layer in layers:
        fn(layer)
    started = time.perf_counter()
    for _ in range(repeats):
        for layer in layers:
            fn(layer)
    return (time.perf_counter() - started) / (repeats * len(layers))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=45)
    p.add_argument("--context", type=int, default=340)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=1456, help="512 MiB of float32 / 30 layers")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--amx-ab", action="store_true", help="bf16 only: AMX scores on vs off")
    args = p.parse_args()
    if args.amx_ab:
        amx_ab(args)
        return
    cpu = torch.device("cpu")
    reference, paged = select_backend("torch", cpu), select_backend("cpu-paged", cpu)
    md = scattered_metadata(args)
    raw_query = torch.randn(args.batch, args.heads, args.head_dim)
    scale = args.head_dim**-0.5
    print(f"batch {args.batch} x {args.context} tokens, {args.heads} heads / {args.kv_heads} KV "
          f"heads x {args.head_dim}, {args.layers} layers, {torch.get_num_threads()} "
          "thread(s); ms per layer")  # fmt: skip
    print("| KV dtype | torch (ms) | cpu-paged (ms) | speed-up | max abs diff |")
    print("|---|---:|---:|---:|---:|")
    for kv_dtype in KV_DTYPES:
        layers = make_layers(kv_dtype, args)
        # A bf16 cache sits under a bf16 model, whose queries are bf16 values (the kernel's
        # AVX512-BF16 path takes them as they are, exactly); float32 queries elsewhere.
        query = raw_query.bfloat16().float() if kv_dtype == "bfloat16" else raw_query
        expected = reference._decode(query, layers[0], md, scale)
        diff = (paged._decode(query, layers[0], md, scale) - expected).abs().max().item()
        ref_s = seconds_per_call(
            lambda layer, q=query: reference._decode(q, layer, md, scale), layers, args.repeats
        )
        new_s = seconds_per_call(
            lambda layer, q=query: paged._decode(q, layer, md, scale), layers, args.repeats
        )
        print(f"| {kv_dtype} | {ref_s * 1e3:.2f} | {new_s * 1e3:.2f} | {ref_s / new_s:.1f}x "
              f"| {diff:.1e} |")  # fmt: skip
        del layers


def amx_ab(args: argparse.Namespace) -> None:
    """The bf16 cache's decode with the AMX scores off and on, alternating, --repeats rounds."""
    paged = select_backend("cpu-paged", torch.device("cpu"))
    layers, md = make_layers("bfloat16", args), scattered_metadata(args)
    query = torch.randn(args.batch, args.heads, args.head_dim).bfloat16().float()
    scale = args.head_dim**-0.5
    times: dict[bool, list[float]] = {False: [], True: []}

    def decode(layer: object) -> None:
        paged._decode(query, layer, md, scale)

    try:
        for _ in range(args.repeats):
            for amx in (False, True):
                ops.kernels().use_amx_decode(amx)
                times[amx].append(seconds_per_call(decode, layers, 1))
    finally:
        ops.kernels().use_amx_decode(True)
    for amx, label in ((False, "vdpbf16ps scores"), (True, "AMX scores")):
        print(f"{label}: " + ", ".join(f"{t * 1e3:.3f}" for t in times[amx]) + " ms a layer")


if __name__ == "__main__":
    main()
