"""The `multi-turn` workload of `kvserve bench serve`: chat conversations that share a system
prompt, each turn resending the whole history.

    conversation c, turn t (0-based) posts
        system  (--system-prompt-len tokens, the same text in every conversation)
        user 0, assistant 0, ..., user t-1, assistant t-1   (the model's own answers)
        user t  (--turn-input-len new tokens)
    with max_tokens --turn-output-len

--num-prompts conversations of --num-turns turns; --max-concurrency conversations are in
flight at once (each runs its turns one after another, so their turns interleave), all of
them when it is not set.  A turn's prompt is mostly the previous turn's prompt and answer: a
prefix cache that kept them serves it, and TTFT and the cached fraction of turns 2+ say how
well (`turn_summary`; the cached tokens are the server's `usage.prompt_tokens_details`).
vLLM's multi-turn benchmark (benchmarks/multi_turn) is a script of its own with the same
shape; here it is one more dataset, with vLLM's serving flags.
"""

from __future__ import annotations

import asyncio
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvserve.bench.client import RequestSpec, send_request
from kvserve.bench.config import DatasetConfig
from kvserve.bench.datasets import SampleRequest, as_text, usable_ids
from kvserve.bench.metrics import RequestRecord


@dataclass(frozen=True)
class Conversation:
    system: str
    user_turns: tuple[str, ...]


def conversations(config: DatasetConfig, tokenizer: Any) -> list[Conversation]:
    """--num-prompts conversations over one system prompt, deterministic in --seed; each text
    is random token ids decoded to exactly its length (bench/datasets.py as_text)."""
    rng, ids = random.Random(config.seed), usable_ids(tokenizer)

    def text(num_tokens: int) -> str:
        sample = SampleRequest([rng.choice(ids) for _ in range(num_tokens)], num_tokens, 0)
        return str(as_text(sample, tokenizer).prompt)

    system = text(config.system_prompt_len)
    return [
        Conversation(system, tuple(text(config.turn_input_len) for _ in range(config.num_turns)))
        for _ in range(config.num_prompts)
    ]


def turn_messages(conversation: Conversation, answers: list[str]) -> list[dict[str, str]]:
    """The messages of the turn after `answers` (one per turn done): the whole history."""
    messages = [{"role": "system", "content": conversation.system}]
    for user, answer in zip(conversation.user_turns, answers, strict=False):
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    messages.append({"role": "user", "content": conversation.user_turns[len(answers)]})
    return messages


async def run_conversations(
    session: aiohttp.ClientSession,
    spec: RequestSpec,
    config: DatasetConfig,
    items: list[Conversation],
    max_active: int,
    t0: float,
    count_tokens: Callable[[str], int] | None = None,
    on_record: Callable[[], None] = lambda: None,
) -> list[RequestRecord]:
    """Every turn of every conversation, `max_active` conversations at a time; the records
    in conversation order, then turn order (`record.turn` set).  A failed turn ends its
    conversation (the next turn would lack its answer)."""
    queue = list(reversed(range(len(items))))
    done: dict[int, list[RequestRecord]] = {}

    async def worker() -> None:
        while queue:
            index = queue.pop()
            conversation, answers, records = items[index], [], []
            for turn in range(config.num_turns):
                messages = turn_messages(conversation, answers)
                sample = SampleRequest(messages[-1]["content"], config.turn_input_len,
                                       config.turn_output_len, messages=messages)  # fmt: skip
                record = await send_request(session, spec, sample, t0, count_tokens)
                record.turn = turn
                records.append(record)
                on_record()
                if not record.success:
                    break
                answers.append(record.generated_text)
            done[index] = records

    await asyncio.gather(*(worker() for _ in range(min(max_active, len(items)))))
    return [r for index in sorted(done) for r in done[index]]


def turn_summary(records: list[RequestRecord]) -> dict[str, dict[str, float]]:
    """TTFT p50/p90 (ms) and the mean cached fraction of the prompts, for turn 1 and for
    turns 2+ (successful turns only)."""
    groups = {"turn 1": [r for r in records if r.turn == 0 and r.success],
              "turns 2+": [r for r in records if (r.turn or 0) > 0 and r.success]}  # fmt: skip
    out = {}
    for name, group in groups.items():
        if not group:
            continue
        ttfts = sorted(r.ttft * 1000 for r in group)
        out[name] = {
            "count": len(group),
            "ttft_p50_ms": _percentile(ttfts, 50),
            "ttft_p90_ms": _percentile(ttfts, 90),
            "mean_cached_fraction": statistics.fmean(
                r.cached_tokens / r.input_len if r.input_len else 0.0 for r in group
            ),
        }
    return out


def _percentile(sorted_values: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    position = (len(sorted_values) - 1) * p / 100
    low = int(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)
