"""Prompts of a serving benchmark: `random`, `sharegpt` and `prefix` (`multi-turn` chats:
bench/multi_turn.py).

Random and prefix prompts are token-id lists, so their lengths are exact; the completions API
takes them as they are.  The chat API needs text, so `as_text` decodes the ids and re-encodes
until the text is exactly as many tokens long (before the chat template adds its own).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve.bench.config import DatasetConfig
from kvserve.errors import ParameterError

# ShareGPT filters (vLLM's): drop tiny and huge conversations.
_MIN_TOKENS, _MAX_PROMPT, _MAX_TOTAL = 4, 1024, 2048


@dataclass(frozen=True)
class SampleRequest:
    """One request to send: the prompt (token ids or text), its length in tokens, max_tokens;
    for a chat turn, the whole conversation so far (`messages`, sent instead of `prompt`)."""

    prompt: list[int] | str
    prompt_len: int
    output_len: int
    messages: list[dict[str, str]] | None = None


def sample_requests(config: DatasetConfig, tokenizer: Any) -> list[SampleRequest]:
    """The benchmark's requests, deterministic in `config.seed`."""
    rng = random.Random(config.seed)
    if config.dataset_name == "random":
        return random_requests(config, usable_ids(tokenizer), rng)
    if config.dataset_name == "prefix":
        return prefix_requests(config, usable_ids(tokenizer), rng)
    return sharegpt_requests(config, tokenizer, rng)


def usable_ids(tokenizer: Any) -> list[int]:
    """Token ids a random prompt may use: the vocabulary without special tokens, which the
    server would treat as control tokens (EOS, chat markers)."""
    special = set(tokenizer.all_special_ids)
    return [i for i in range(len(tokenizer)) if i not in special]


def _length(rng: random.Random, mean: int, ratio: float) -> int:
    """Uniform in [mean x (1 - ratio), mean x (1 + ratio)], at least 1."""
    low, high = int(mean * (1 - ratio)), int(mean * (1 + ratio))
    return max(1, rng.randint(low, high))


def random_requests(
    config: DatasetConfig, ids: list[int], rng: random.Random
) -> list[SampleRequest]:
    out = []
    for _ in range(config.num_prompts):
        input_len = _length(rng, config.random_input_len, config.random_range_ratio)
        output_len = _length(rng, config.random_output_len, config.random_range_ratio)
        prompt = [rng.choice(ids) for _ in range(input_len)]
        out.append(SampleRequest(prompt, input_len, output_len))
    return out


def prefix_requests(
    config: DatasetConfig, ids: list[int], rng: random.Random
) -> list[SampleRequest]:
    """`num_prefixes` shared prefixes of `prefix_len` tokens, each prompt one of them plus
    `suffix_len` unique tokens: the prefix cache should compute each prefix once."""
    prefixes = [
        [rng.choice(ids) for _ in range(config.prefix_len)] for _ in range(config.num_prefixes)
    ]
    output_len = config.output_len or 128
    out = []
    for i in range(config.num_prompts):
        suffix = [rng.choice(ids) for _ in range(config.suffix_len)]
        prompt = prefixes[i % config.num_prefixes] + suffix
        out.append(SampleRequest(prompt, len(prompt), output_len))
    return out


def sharegpt_requests(
    config: DatasetConfig, tokenizer: Any, rng: random.Random
) -> list[SampleRequest]:
    """First human turn as the prompt, the reply's length as max_tokens (or --output-len)."""
    conversations = _load_sharegpt(Path(config.dataset_path or ""))
    rng.shuffle(conversations)
    out: list[SampleRequest] = []
    for prompt, reply in conversations:
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        output_len = config.output_len or len(tokenizer.encode(reply, add_special_tokens=False))
        too_short = prompt_len < _MIN_TOKENS or output_len < _MIN_TOKENS
        if too_short or prompt_len > _MAX_PROMPT or prompt_len + output_len > _MAX_TOTAL:
            continue
        out.append(SampleRequest(prompt, prompt_len, output_len))
        if len(out) == config.num_prompts:
            break
    if len(out) < config.num_prompts:
        raise ParameterError(
            "--dataset-path",
            f"has {len(out)} usable conversations, fewer than "
            f"--num-prompts {config.num_prompts}; lower --num-prompts",
        )
    return out


def _load_sharegpt(path: Path) -> list[tuple[str, str]]:
    """(first turn, second turn) of each conversation with at least two turns."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ParameterError("--dataset-path", f"cannot read ShareGPT JSON {path}: {exc}") from None
    pairs = []
    for item in data if isinstance(data, list) else []:
        turns = item.get("conversations") or item.get("conversation") or []
        if len(turns) >= 2 and "value" in turns[0] and "value" in turns[1]:
            pairs.append((turns[0]["value"], turns[1]["value"]))
    if not pairs:
        raise ParameterError("--dataset-path", f"{path}: no conversations in ShareGPT format")
    return pairs


def as_text(request: SampleRequest, tokenizer: Any, max_tries: int = 10) -> SampleRequest:
    """The same request with a text prompt that re-encodes to exactly `prompt_len` tokens
    (for the chat API).  Decoding merges or splits some tokens, so trim or pad and retry;
    after `max_tries` keep the closest text and record its true length."""
    if isinstance(request.prompt, str):
        return request
    target, ids = request.prompt_len, list(request.prompt)
    text, length = "", 0
    for _ in range(max_tries):
        text = tokenizer.decode(ids, skip_special_tokens=True)
        encoded = tokenizer.encode(text, add_special_tokens=False)
        length = len(encoded)
        if length == target:
            break
        ids = encoded[:target] if length > target else encoded + ids[: target - length]
    return SampleRequest(text, length, request.output_len)
