"""What --weight-dtype costs in quality: perplexity and greedy agreement of each weight format
against the first (float by default), on one model, with an unquantized KV cache.

    .venv/bin/python -m kvserve.evaluation.sample_text ref.txt
    .venv/bin/python benchmarks/weight_dtype_quality.py --text ref.txt

Each format's model is loaded as `kvserve eval-kv --weight-dtype X` loads it (float32 on a
CPU unless --dtype says otherwise); the perplexity runs windows of --context-len tokens over
the first --max-eval-tokens tokens of the text, the greedy run --num-prompts prompts of
--prompt-len tokens, --max-tokens tokens each, all decoded side by side (one row each).
"""

from __future__ import annotations

import argparse
import json
import time

from kvserve.config import EngineConfig, LoadConfig
from kvserve.evaluation import greedy, perplexity
from kvserve.evaluation.kv_eval import load_model, sample_prompts
from kvserve.evaluation.paged import allocate_cache


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--text", required=True, help="UTF-8 text file to evaluate on.")
    parser.add_argument("--model", default=None, help="Default: the embedded model.")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--weight-dtypes", default="float,int8", help="Reference first.")
    parser.add_argument("--context-len", type=int, default=512)
    parser.add_argument("--chunk-size", type=int, default=512)
    parser.add_argument(
        "--tokens-per-step", type=int, default=perplexity.TOKENS_PER_STEP,
        help="Rows of a perplexity step (windows side by side). With --chunk-size 8 and 8, "
        "every step takes the decode kernels (up to 8 rows), so that int4's rounding of the "
        "activations is measured; larger steps multiply the float weights.",
    )  # fmt: skip
    parser.add_argument("--max-eval-tokens", type=int, default=8192)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    return parser.parse_args()


def evaluate(args: argparse.Namespace, weight_dtype: str) -> tuple[float, int, list[list[int]]]:
    """(perplexity, tokens predicted, greedy continuations) of one weight format."""
    perplexity.TOKENS_PER_STEP = args.tokens_per_step  # windows a step: its row count
    config = EngineConfig(load=LoadConfig(model=args.model, dtype=args.dtype))
    loaded = load_model(config, weight_dtype)
    token_ids = loaded.tokenizer.encode(open(args.text, encoding="utf-8").read())
    blocks = perplexity.cache_blocks_needed(args.context_len, args.chunk_size, args.block_size)
    cache = allocate_cache(loaded.config, "auto", loaded.dtype, args.block_size, blocks,
                           loaded.device)  # fmt: skip
    ppl = perplexity.perplexity(loaded.model, cache, token_ids[: args.max_eval_tokens],
                                args.context_len, args.chunk_size, loaded.device)  # fmt: skip
    prompts = sample_prompts(token_ids, args.num_prompts, args.prompt_len)
    blocks = greedy.cache_blocks_needed(len(prompts), args.prompt_len, args.max_tokens,
                                        args.block_size)  # fmt: skip
    cache = allocate_cache(loaded.config, "auto", loaded.dtype, args.block_size, blocks,
                           loaded.device)  # fmt: skip
    tokens = greedy.greedy_generate(loaded.model, cache, prompts, args.max_tokens,
                                    args.chunk_size, loaded.device)  # fmt: skip
    return ppl.perplexity, ppl.num_predicted, tokens


def main() -> None:
    args = parse_args()
    rows, reference = [], None
    for weight_dtype in args.weight_dtypes.split(","):
        started = time.monotonic()
        ppl, predicted, tokens = evaluate(args, weight_dtype)
        reference = reference or (ppl, tokens)
        agreement = greedy.greedy_agreement(reference[1], tokens)
        rows.append({
            "weight_dtype": weight_dtype, "perplexity": ppl, "num_predicted": predicted,
            "relative_perplexity": ppl / reference[0] - 1.0, "agreement": agreement.share,
            "mean_identical_prefix": agreement.mean_identical_prefix,
            "num_prompts_identical": agreement.num_prompts_identical,
            "seconds": time.monotonic() - started,
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    print("| weight dtype | perplexity | vs first | greedy agreement | identical prefix |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['weight_dtype']} | {r['perplexity']:.4f} | {r['relative_perplexity']:+.2%} "
              f"| {r['agreement']:.3f} | {r['mean_identical_prefix']:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
