"""The naive serving baseline: Hugging Face transformers `generate` in static batches with a
contiguous, left-padded KV cache (transformers' DynamicCache), on the embedded model.

Same prompts as `kvserve bench serve` (the bench's own random dataset and seed), same KV
memory budget.  A contiguous cache must reserve each sequence's KV for the longest it may
grow, so at most floor(budget / (bytes_per_token x reserved_len)) sequences run together, and
a batch ends only when its longest member does.  What is reserved (--reserve):

  max-model-len  the context length the server accepts (--max-model-len, 2048 as kvserve is
                 served in serve_workloads.py): a naive server cannot know how long a request
                 will grow, so every slot is sized for the longest allowed sequence (what
                 FasterTransformer and Orca (Max) do in the PagedAttention paper).
  request        an oracle that knows each workload's longest prompt + output (Orca (Oracle)):
                 no naive server has this knowledge; it is the strictest comparison.

Two modes:
  offline (W1): all requests queued at t = 0, batches back to back.
  online  (W2): requests arrive at the bench's Poisson times; whenever the model is free it
                takes every arrived request (up to the batch limit) as one static batch.

    .venv/bin/python benchmarks/baseline_hf.py --num-prompts 32 --kv-cache-memory 512MiB \
        --reserve max-model-len --max-model-len 2048
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvserve.bench.config import DatasetConfig
from kvserve.bench.datasets import SampleRequest, sample_requests
from kvserve.bench.runner import arrival_offsets
from kvserve.config import parse_size


@dataclass(frozen=True)
class BaselineModel:
    model: Any
    tokenizer: Any
    bytes_per_token: int  # KV bytes of one token (all layers, K and V, float32)


def load_baseline_model(cpus: str | None = None) -> BaselineModel:
    """The embedded GGUF through transformers (dequantized to float32, like kvserve), with
    one torch thread per CPU it may use, as kvserve sizes its own."""
    from transformers import AutoModelForCausalLM

    from kvserve.models.loader import embedded_model_path
    from kvserve.tokenizer import load_tokenizer

    if cpus:
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    path = embedded_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 4
    return BaselineModel(model, load_tokenizer(path), per_token)


def static_batch_size(budget_bytes: int, bytes_per_token: int, max_len: int) -> int:
    """Sequences whose whole-length KV fits the budget at once (at least 1)."""
    return max(1, budget_bytes // (bytes_per_token * max_len))


def generate_batch(base: BaselineModel, batch: list[SampleRequest]) -> None:
    """One static batch: left-pad to the longest prompt, greedy, exactly max_tokens each
    (EOS ignored like --ignore-eos: the batch runs to its longest output)."""
    longest = max(r.prompt_len for r in batch)
    pad = base.tokenizer.pad_token_id
    pad = pad if pad is not None else base.tokenizer.eos_token_id
    ids = torch.full((len(batch), longest), pad, dtype=torch.long)
    mask = torch.zeros((len(batch), longest), dtype=torch.long)
    for row, r in enumerate(batch):
        ids[row, longest - r.prompt_len :] = torch.tensor(r.prompt)
        mask[row, longest - r.prompt_len :] = 1
    num_new = max(r.output_len for r in batch)
    with torch.inference_mode():
        base.model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=num_new,
            min_new_tokens=num_new,
            do_sample=False,
            pad_token_id=pad,
        )


def run_offline(base: BaselineModel, requests: list[SampleRequest], batch_size: int) -> dict:
    """All requests queued at once, batches back to back (W1)."""
    started, cpu = time.perf_counter(), time.process_time()
    for i in range(0, len(requests), batch_size):
        generate_batch(base, requests[i : i + batch_size])
    duration = time.perf_counter() - started
    return _summary(requests, duration, time.process_time() - cpu, batch_size, latencies=None)


def run_online(
    base: BaselineModel, requests: list[SampleRequest], batch_size: int, rate: float, seed: int
) -> dict:
    """Requests arrive at the bench's Poisson times (same seed); a free model takes all that
    have arrived, up to the batch limit (W2).  Latency = batch end - arrival."""
    arrivals = arrival_offsets(len(requests), rate, 1.0, seed)
    started, cpu, done, latencies = time.perf_counter(), time.process_time(), 0, []
    while done < len(requests):
        now = time.perf_counter() - started
        if arrivals[done] > now:
            time.sleep(arrivals[done] - now)
            now = arrivals[done]
        end = done
        while end < len(requests) and end - done < batch_size and arrivals[end] <= now:
            end += 1
        generate_batch(base, requests[done:end])
        finished = time.perf_counter() - started
        latencies += [finished - arrivals[i] for i in range(done, end)]
        done = end
    duration = time.perf_counter() - started
    return _summary(requests, duration, time.process_time() - cpu, batch_size, latencies)


def _summary(
    requests: list[SampleRequest],
    duration: float,
    cpu_seconds: float,
    batch_size: int,
    latencies: list | None,
) -> dict:
    """Throughputs by wall time and, steadier on a shared machine, by this process's CPU time
    (sleeps between arrivals cost none)."""
    num_in = sum(r.prompt_len for r in requests)
    num_out = sum(r.output_len for r in requests)
    row = {
        "system": "hf-static-batch",
        "num_requests": len(requests),
        "batch_size": batch_size,
        "duration": duration,
        "request_throughput": len(requests) / duration,
        "output_throughput": num_out / duration,
        "total_token_throughput": (num_in + num_out) / duration,
        "cpu_seconds": cpu_seconds,
        "output_tokens_per_cpu_second": num_out / cpu_seconds,
    }
    if latencies:
        ordered = sorted(latencies)
        row["mean_e2el_ms"] = 1000 * statistics.mean(latencies)
        row["median_e2el_ms"] = 1000 * statistics.median(latencies)
        row["p99_e2el_ms"] = (
            1000 * ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
        )
    return row


def w1_dataset(args: argparse.Namespace) -> DatasetConfig:
    """W1's random dataset from the arguments both scripts share (num_prompts, input_len,
    output_len, range_ratio, seed)."""
    return DatasetConfig(
        num_prompts=args.num_prompts,
        random_input_len=args.input_len,
        random_output_len=args.output_len,
        random_range_ratio=args.range_ratio,
        seed=args.seed,
    )


def w1_requests(tokenizer: Any, args: argparse.Namespace) -> list[SampleRequest]:
    """Exactly the prompts `kvserve bench serve --dataset-name random` sends for W1."""
    return sample_requests(w1_dataset(args), tokenizer)


RESERVE_MODES = ("max-model-len", "request")


def reserved_length(
    reserve: str, input_len: int, output_len: int, range_ratio: float, max_model_len: int
) -> int:
    """Tokens a static batch reserves per sequence (see the module docstring)."""
    if reserve == "max-model-len":
        return max_model_len
    if reserve == "request":
        # The longest prompt plus the longest output the random dataset can draw.
        return int(input_len * (1 + range_ratio)) + int(output_len * (1 + range_ratio))
    raise ValueError(f"--reserve must be one of {', '.join(RESERVE_MODES)}, got {reserve!r}")


def run_baseline(
    base: BaselineModel,
    requests: list[SampleRequest],
    budget_bytes: int,
    reserved_len: int,
    request_rate: float,
    seed: int,
) -> dict:
    """Offline (rate inf, W1) or online (W2) static batching under the budget."""
    batch = static_batch_size(budget_bytes, base.bytes_per_token, reserved_len)
    if math.isinf(request_rate):
        result = run_offline(base, requests, batch)
    else:
        result = run_online(base, requests, batch, request_rate, seed)
    return {"reserved_len": reserved_len, **result}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--kv-cache-memory", default="512MiB")
    p.add_argument("--range-ratio", type=float, default=0.0, help="--random-range-ratio")
    p.add_argument("--request-rate", type=float, default=math.inf, help="inf: offline (W1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reserve", default="max-model-len", choices=RESERVE_MODES)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--cpus", default=None, help="pin to these CPUs, e.g. 0 or 0,1")
    p.add_argument("--out", default=None, help="JSON file for the result")
    args = p.parse_args()
    base = load_baseline_model(args.cpus)
    requests = w1_requests(base.tokenizer, args)
    reserved = reserved_length(
        args.reserve, args.input_len, args.output_len, args.range_ratio, args.max_model_len
    )
    result = run_baseline(
        base, requests, parse_size(args.kv_cache_memory), reserved, args.request_rate, args.seed
    )
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
