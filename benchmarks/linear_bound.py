"""The matrix-product bound of W1 on this machine: the embedded model's linear layers alone
(every projection of every layer, and the LM head for the rows that sample), at W1's shapes,
with the weights, dtype and threads kvserve serves with (prepacked bfloat16 on a CPU with
native bf16).  Nothing else runs: no attention, no element-wise work, no engine.  Beside it,
the floor of the attention it leaves out: the bytes of K and V that W1's decode steps read, at
the machine's streaming read rate (docs/benchmarks.md, offline W1 against its bound).

    W1 prefill: num_prompts x 256 tokens in chunks of --max-num-batched-tokens rows
    W1 decode:  128 steps of num_prompts rows (the whole batch decodes together)

    .venv/bin/python benchmarks/linear_bound.py --num-prompts 128
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kvserve import LLM
from kvserve.allocator import reexec_with_allocator
from kvserve.kv.spec import cdiv

INPUT_LEN, OUTPUT_LEN = 256, 128


def projections(model: torch.nn.Module) -> list[torch.nn.Module]:
    names = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    return [getattr(layer, name) for layer in model.layers for name in names]


@torch.inference_mode()
def seconds_per_pass(model: torch.nn.Module, rows: int, sampled_rows: int, repeat: int) -> float:
    """One forward's linear work on `rows` tokens, `sampled_rows` of them through the LM head."""
    dtype = next(model.parameters()).dtype
    layers = projections(model)
    inputs = [torch.randn(rows, layer.in_features, dtype=dtype) for layer in layers]
    hidden = torch.randn(sampled_rows, model.config.hidden_size, dtype=dtype)
    for _ in range(2):
        for layer, x in zip(layers, inputs, strict=True):
            layer(x)
    started = time.perf_counter()
    for _ in range(repeat):
        for layer, x in zip(layers, inputs, strict=True):
            layer(x)
        model.compute_logits(hidden)
    return (time.perf_counter() - started) / repeat


def w1_kv_read_bytes(model: torch.nn.Module, num_prompts: int, element_bytes: int) -> int:
    """Bytes of K and V W1's decode steps read: every sequence attends its whole context once
    per layer and step, over INPUT_LEN + 1 .. INPUT_LEN + OUTPUT_LEN - 1 tokens (the first
    output token comes from the prefill)."""
    layer = model.layers[0]
    token_steps = sum(range(INPUT_LEN + 1, INPUT_LEN + OUTPUT_LEN))
    per_token = len(model.layers) * layer.num_kv_heads * layer.head_dim * 2 * element_bytes
    return num_prompts * token_steps * per_token


def read_bytes_per_second(size: int = 2**30, repeat: int = 5) -> float:
    """The machine's streaming read rate with torch's threads: the best of `repeat` sums over
    `size` bytes (a plain C read loop measured within a few % of it on the project's VMs)."""
    x = torch.ones(size // 4)
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - started)
    return size / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    reexec_with_allocator()  # the allocator `kvserve serve` runs with (allocator.py)
    llm = LLM(kv_cache_memory=64 * 2**20, max_model_len=1024, enforce_eager=True)
    model = llm.engine.executor.driver_worker.model
    chunk = args.max_num_batched_tokens
    num_chunks = cdiv(args.num_prompts * INPUT_LEN, chunk)
    prefill = seconds_per_pass(model, chunk, chunk // INPUT_LEN, repeat=3)
    decode = seconds_per_pass(model, args.num_prompts, args.num_prompts, repeat=10)
    kv_bytes = w1_kv_read_bytes(model, args.num_prompts, llm.engine.executor.dtype.itemsize)
    read_rate = read_bytes_per_second()
    result = {
        "dtype": str(llm.engine.executor.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "prefill_chunk_seconds": prefill,
        "prefill_tokens_per_second": chunk / prefill,
        "decode_step_seconds": decode,
        "w1_prefill_seconds": num_chunks * prefill,
        "w1_decode_seconds": OUTPUT_LEN * decode,
        "w1_seconds": num_chunks * prefill + OUTPUT_LEN * decode,
        # The attention the bound leaves out cannot take less than its K/V reads at the
        # streaming rate (with a cache of the model's dtype, as `kvserve serve` runs).
        "w1_kv_read_bytes": kv_bytes,
        "read_bytes_per_second": read_rate,
        "w1_kv_read_seconds": kv_bytes / read_rate,
    }
    print(json.dumps(result) if args.json else json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
