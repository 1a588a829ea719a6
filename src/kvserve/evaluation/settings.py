"""`kvserve eval-kv`'s settings, apart from the evaluation itself: the CLI builds its parser
from them without importing torch, so every `kvserve` command (and each error it prints)
starts without the evaluation's imports (~3 s, twice where the command re-executes itself
with tcmalloc: allocator.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.errors import ParameterError


@dataclass(frozen=True)
class EvalSettings:
    """`kvserve eval-kv`'s own flags (block_size comes from the engine's --block-size)."""

    num_prompts: int = field(
        default=8, metadata={"help": "Prompts for greedy agreement (0 skips it)."}
    )
    prompt_len: int = field(default=64, metadata={"help": "Tokens per greedy prompt."})
    max_tokens: int = field(default=32, metadata={"help": "Greedy tokens generated per prompt."})
    context_len: int = field(default=512, metadata={"help": "Tokens per perplexity window."})
    chunk_size: int = field(
        default=32,
        metadata={"help": "Prefill chunk size: chunks after a window's first read the cache."},
    )
    max_eval_tokens: int = field(
        default=20480,
        metadata={"help": "Perplexity over the text's first N tokens (0: the whole text)."},
    )
    block_size: int = 16

    def __post_init__(self) -> None:
        for name in ("context_len", "chunk_size", "prompt_len", "block_size"):
            if getattr(self, name) <= 0:
                raise ParameterError(f"--{name.replace('_', '-')}", "must be positive")
        for name in ("num_prompts", "max_tokens", "max_eval_tokens"):
            if getattr(self, name) < 0:
                raise ParameterError(f"--{name.replace('_', '-')}", "must be >= 0")
