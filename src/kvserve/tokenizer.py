"""Tokenizer (Hugging Face), chat template, incremental detokenizer and stop strings.

For a GGUF file, transformers converts the embedded vocabulary into a fast tokenizer; that
takes seconds, so the converted tokenizer is saved once under ~/.cache/kvserve (or
$KVSERVE_CACHE_DIR), keyed by the file's path, size and modification time.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def _cache_dir() -> Path:
    root = os.environ.get("KVSERVE_CACHE_DIR") or Path.home() / ".cache" / "kvserve"
    return Path(root) / "tokenizers"


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """Tokenizer of a HF directory or a GGUF file."""
    if path.is_dir():
        return AutoTokenizer.from_pretrained(str(path))
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    cached = _cache_dir() / key.hexdigest()[:16]
    if (cached / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(str(cached))
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    try:
        tokenizer.save_pretrained(str(cached))
    except OSError:
        pass  # a read-only home only costs the conversion next time
    return tokenizer


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]]
) -> list[int]:
    """Token ids of a conversation with the assistant's turn opened."""
    if not tokenizer.chat_template:
        raise ValueError("this model has no chat template; use /v1/completions")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


@dataclass
class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text as they arrive.

    Decodes a short window (from `prefix_offset`) so each step costs O(window), and holds back
    text ending in an incomplete UTF-8 character (U+FFFD) until the next token completes it.
    Stop strings are searched only where the new text could complete one.
    """

    tokenizer: PreTrainedTokenizerBase
    skip_special_tokens: bool = True
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    stopped_by: str | None = None

    def add(self, token_ids: list[int]) -> None:
        """Append tokens to `text`.  When a stop string matches, `text` is truncated there and
        `stopped_by` names it."""
        self.token_ids.extend(token_ids)
        decode = self.tokenizer.decode
        prefix = decode(
            self.token_ids[self.prefix_offset : self.read_offset],
            skip_special_tokens=self.skip_special_tokens,
        )
        full = decode(
            self.token_ids[self.prefix_offset :], skip_special_tokens=self.skip_special_tokens
        )
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return
        delta = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self._append(delta)

    def visible_text(self, finished: bool) -> str:
        """Text safe to show: while running, hold back what could still become a stop string."""
        if finished or not self.stop or self.include_stop_str_in_output:
            return self.text
        holdback = self._longest_stop - 1
        return self.text[: max(0, len(self.text) - holdback)]

    def _append(self, delta: str) -> None:
        old_len = len(self.text)
        self.text += delta
        if not self.stop:
            return
        match = earliest_stop(self.text, self.stop, max(0, old_len - self._longest_stop + 1))
        if match is not None:
            at, stop = match
            self.text = self.text[: at + len(stop) if self.include_stop_str_in_output else at]
            self.stopped_by = stop

    @property
    def _longest_stop(self) -> int:
        return max(len(s) for s in self.stop)


def earliest_stop(text: str, stops: tuple[str, ...], start: int) -> tuple[int, str] | None:
    """(position, stop string) of the match that starts first in text[start:], the longer
    one on a tie; None when none occurs.  The text decides, not the order of `stops`: when
    two fall in one delta, output ends where the first one begins."""
    best: tuple[int, str] | None = None
    for stop in stops:
        at = text.find(stop, start)
        if at >= 0 and (best is None or (at, -len(stop)) < (best[0], -len(best[1]))):
            best = (at, stop)
    return best
