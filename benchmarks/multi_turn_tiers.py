"""Multi-turn chat against the prefix cache's tiers: conversations sharing a system
prompt, each turn resending its whole history, `--concurrency` conversations at a time, on the
in-process engine.  Prints TTFT p50 of turns 2+ (wall time from a turn's arrival to its first
token, queueing included) and the mean fraction of their prompts found cached, per config.

    PYTHONPATH=src python benchmarks/multi_turn_tiers.py --conversations 8 --turns 3 \\
        --answer-tokens 16 --kv-cache-mib 48 --configs off,none:0.05,int8:0.05,int8:0.02:disk
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field

from kvserve import LLM, SamplingParams

WORDS = (
    "the a of to and in is it that for on was with as his they at be this from have or by one "
    "had not but what all were when we there can an your which their said if do will each "
    "about how up out them then she many some so these would other into has more her two like "
    "him see time could no make than first been its who now people my made over did down only "
    "way find use may water long little very after words called just where most know"
).split()


def sentence(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words)).capitalize() + "."


@dataclass
class Conversation:
    index: int
    history: list[int]
    turn: int = 0
    answers: list[list[int]] = field(default_factory=list)


def user_tokens(tokenizer, rng: random.Random, num_tokens: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < num_tokens:
        ids += tokenizer.encode(" " + sentence(rng, 12))
    return ids[:num_tokens]


def run(llm: LLM, args: argparse.Namespace) -> dict[str, float]:
    engine, tok = llm.engine, llm.get_tokenizer()
    rng = random.Random(0)
    system = user_tokens(tok, rng, args.system_tokens)
    users = {
        (c, t): user_tokens(tok, rng, args.user_tokens)
        for c in range(args.conversations)
        for t in range(args.turns)
    }
    params = SamplingParams(temperature=0.0, max_tokens=args.answer_tokens, ignore_eos=True)
    pending = [Conversation(c, list(system)) for c in range(args.conversations)]
    active: dict[str, tuple[Conversation, float, int]] = {}
    ttfts, fractions, answers = [], [], {}
    first_seen: set[str] = set()

    def start(conv: Conversation) -> None:
        conv.history += users[(conv.index, conv.turn)]
        rid = f"c{conv.index}t{conv.turn}"
        engine.add_request(rid, list(conv.history), params)
        active[rid] = (conv, time.perf_counter(), len(conv.history))

    for _ in range(min(args.concurrency, len(pending))):
        start(pending.pop(0))
    while active:
        for out in engine.step():
            conv, t0, num_prompt = active[out.request_id]
            if out.request_id not in first_seen and out.outputs[0].token_ids:
                first_seen.add(out.request_id)
                if conv.turn > 0:
                    ttfts.append(time.perf_counter() - t0)
            if not out.finished:
                continue
            del active[out.request_id]
            ids = list(out.outputs[0].token_ids)
            answers[out.request_id] = ids
            if conv.turn > 0:
                fractions.append(out.num_cached_tokens / num_prompt)
            conv.history += ids
            conv.turn += 1
            if conv.turn < args.turns:
                pending.append(conv)  # back of the queue: others' turns interleave
            if pending:
                start(pending.pop(0))
            if args.progress and len(answers) % args.progress == 0:
                print(f"  {len(answers)} turns done", flush=True)
    stats = engine.get_stats()
    host = engine.cache_manager.host
    disk = host.disk if host is not None else None
    return {
        "ttft_p50_ms": statistics.median(ttfts) * 1e3,
        "cached_fraction": statistics.mean(fractions),
        "loaded_blocks": stats.num_loaded_blocks,
        "disk_reads": disk.stats.num_read_blocks if disk is not None else 0,
        "answers": answers,
    }


def tier_kwargs(config: str) -> dict[str, object]:
    """off -> no tiers; int8:0.05 -> a 0.05 GiB int8 host tier; int8:0.02:disk -> and a disk
    tier below it, in a new temporary folder."""
    if config == "off":
        return {}
    compression, gib, *disk = config.split(":")
    kw: dict[str, object] = {
        "kv_offloading_size": float(gib), "kv_offloading_compression": compression,
    }  # fmt: skip
    if disk:
        kw["kv_offloading_dir"] = tempfile.mkdtemp(prefix="kv-disk-tier-")
    return kw


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=512)
    p.add_argument("--user-tokens", type=int, default=96)
    p.add_argument("--answer-tokens", type=int, default=48)
    p.add_argument("--kv-cache-mib", type=int, default=48)
    p.add_argument("--max-model-len", type=int, default=1088)
    p.add_argument("--progress", type=int, default=0, help="print every N finished turns")
    p.add_argument(
        "--weight-dtype",
        default="auto",
        help="float: the same weights for every step (auto's int8 decode steps make a block's "
        "K/V depend on whether a decode or a prefill computed it)",
    )
    p.add_argument(
        "--configs",
        default="off,none:0.05,int8:0.05,int8:0.02:disk",
        help="comma-separated: off, or COMPRESSION:GIB[:disk] (a disk tier in a fresh folder)",
    )
    args = p.parse_args()
    results = {}
    for config in args.configs.split(","):
        kw = tier_kwargs(config)
        llm = LLM(
            kv_cache_memory=args.kv_cache_mib * 2**20,
            max_model_len=args.max_model_len,
            weight_dtype=args.weight_dtype,
            **kw,
        )
        t0 = time.perf_counter()
        results[config] = r = run(llm, args)
        print(
            f"{config:18s}: TTFT p50 turns 2+ {r['ttft_p50_ms']:.0f} ms, cached fraction "
            f"{r['cached_fraction']:.3f}, host loads {r['loaded_blocks']} "
            f"(disk reads {r['disk_reads']}), "
            f"{time.perf_counter() - t0:.0f} s; {llm.engine.sizing.summary().split(';')[-1]}",
            flush=True,
        )
        del llm
    base = results.get("off")
    for config, r in results.items():
        if base is not None and config != "off":
            same = sum(r["answers"][k] == base["answers"][k] for k in base["answers"])
            print(f"{config}: {same}/{len(base['answers'])} answers equal to the run without tiers")


if __name__ == "__main__":
    main()
