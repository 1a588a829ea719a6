"""`kvserve eval-kv [MODEL] --text FILE`: what each KV cache dtype costs in accuracy.

Prints, per KV dtype, the bytes per token (the engine's accounting), the perplexity of the
text through a paged cache of that dtype, its change relative to the first (reference) dtype,
and the greedy agreement with the reference on prompts taken from the same text.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kvserve.errors import ParameterError
from kvserve.evaluation.settings import EvalSettings
from kvserve.flags import add_engine_args, add_fields, engine_config_from_args, from_args

if TYPE_CHECKING:
    from kvserve.evaluation.kv_eval import KVDtypeResult

DEFAULT_KV_DTYPES = "auto,fp8_e4m3,fp8_e5m2,int8,k8v4,int4,int4_unrotated"

DESCRIPTION = """\
Perplexity and greedy agreement of each KV cache dtype on one model and one text.

Perplexity: the text's first --max-eval-tokens tokens are cut into windows of --context-len
tokens; each window is prefilled in chunks of --chunk-size tokens through a paged KV cache
of the dtype, so later chunks attend over K/V read back from that cache; perplexity is
exp(mean NLL) over every predicted token.  KL: the mean, over the same positions, of the
KL divergence of each dtype's next-token distribution from the reference's (in nats; the
dtypes run in lockstep, chunk by chunk).

Greedy agreement: --num-prompts prompts of --prompt-len tokens are taken at evenly spaced
places in the text; each dtype generates --max-tokens greedy tokens (EOS ignored) on its
own, and its tokens are compared with the reference's position by position to the end:
agreement = identical positions / all positions.  Positions after a first divergence count
as whatever they are; "prefix" is the mean number of tokens before the first divergence.

The first dtype of --kv-cache-dtypes is the reference (default: auto, the model's dtype).
Besides the serving dtypes, float32/bfloat16/float16 name an unquantized cache of that dtype
(e.g. a 16-bit cache under a float32 model), and int4_unrotated is int4 without its rotation
(what the rotation buys).  Without --kv-cache-dtypes, a --kv-cache-dtype
other than auto compares auto with that one dtype.

A text to try, available offline: python -m kvserve.evaluation.sample_text ref.txt"""


@dataclass(frozen=True)
class EvalOptions:
    """`kvserve eval-kv`'s own flags besides EvalSettings (and the engine's)."""

    text: str = field(
        default="", metadata={"help": "UTF-8 text file to evaluate on.", "required": True}
    )
    kv_cache_dtypes: str | None = field(
        default=None,
        metadata={
            "help": f"Comma-separated KV dtypes, reference first; default {DEFAULT_KV_DTYPES}."
        },
    )
    json: bool = field(default=False, metadata={"help": "Print the results as JSON."})


def add_eval_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "eval-kv",
        help="Perplexity and greedy agreement of each KV cache dtype on a text.",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_engine_args(p)
    add_fields(p.add_argument_group("EvalOptions"), EvalOptions)
    add_fields(p.add_argument_group("EvalSettings"), EvalSettings)
    p.set_defaults(func=run_eval)


def kv_dtypes_from_args(args: argparse.Namespace) -> list[str]:
    """--kv-cache-dtypes wins; else auto plus a non-auto --kv-cache-dtype; else the default."""
    if args.kv_cache_dtypes:
        return [d.strip() for d in args.kv_cache_dtypes.split(",") if d.strip()]
    if args.kv_cache_dtype != "auto":
        return ["auto", args.kv_cache_dtype]
    return DEFAULT_KV_DTYPES.split(",")


def settings_from_args(args: argparse.Namespace) -> EvalSettings:
    return from_args(EvalSettings, args, block_size=args.block_size)


def run_eval(args: argparse.Namespace) -> int:
    # The evaluation's imports (torch, the model, the tokenizer) only where it runs.
    from kvserve.evaluation.kv_eval import evaluate_kv_dtypes, load_model
    from kvserve.evaluation.paged import check_kv_dtypes
    from kvserve.native import platform

    config = engine_config_from_args(args)
    settings = settings_from_args(args)
    kv_dtypes = kv_dtypes_from_args(args)
    check_kv_dtypes(kv_dtypes)
    text_path = Path(from_args(EvalOptions, args).text)
    if not text_path.is_file():
        raise ParameterError("--text", f"no such file {text_path}; make one with "
                         "`python -m kvserve.evaluation.sample_text ref.txt`")  # fmt: skip
    text = text_path.read_text(encoding="utf-8")
    loaded = load_model(config)
    token_ids = loaded.tokenizer.encode(text)
    results = evaluate_kv_dtypes(loaded, token_ids, kv_dtypes, settings)
    header = {
        "model": loaded.name,
        "model_dtype": platform.dtype_name(loaded.dtype),
        "text": str(text_path),
        "text_tokens": len(token_ids),
        "settings": asdict(settings),
    }
    if args.json:
        print(json.dumps({**header, "results": [r.to_dict() for r in results]}, indent=2))
    else:
        print(format_report(header, results))
    return 0


def format_report(header: dict, results: list[KVDtypeResult]) -> str:
    """A Markdown table, ready to paste into docs/benchmarks.md."""
    s = header["settings"]
    lines = [
        f"model {header['model']} ({header['model_dtype']}), text {header['text']} "
        f"({header['text_tokens']:,} tokens; perplexity over {results[0].num_predicted:,} "
        f"predicted tokens, windows of {s['context_len']} in chunks of {s['chunk_size']}; "
        f"greedy: {s['num_prompts']} prompts x {s['max_tokens']} tokens)",
        "",
        "| KV dtype | stored as | bytes/token | perplexity | vs reference | KL (nats) "
        "| greedy agreement | identical prefix (mean) | prompts identical |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.kv_dtype} | {r.storage_dtype} | {r.bytes_per_token:,} | {r.perplexity:.4f} "
            f"| {100 * r.relative_perplexity:+.3f}% | {r.mean_kl:.5f} | {100 * r.agreement:.1f}% "
            f"| {r.mean_identical_prefix:.1f} | {r.num_prompts_identical}/{s['num_prompts']} |"
        )
    return "\n".join(lines)
