"""Tokenizer (Hugging Face), chat template and incremental detokenizer.

For a GGUF file, transformers converts the embedded vocabulary into a fast tokenizer; that
takes seconds, so the converted tokenizer is saved once under ~/.cache/kvserve (or
$KVSERVE_CACHE_DIR), keyed by the file's path, size and modification time.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from kvserve.config import cache_dir
from kvserve.errors import UserInputError


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """Tokenizer of a HF directory or a GGUF file."""
    if path.is_dir():
        return AutoTokenizer.from_pretrained(str(path))
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    cached = cache_dir("tokenizers") / key.hexdigest()[:16]
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
        raise UserInputError("this model has no chat template; use /v1/completions")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


@dataclass
class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text as they arrive.

    Decodes a short window (from `prefix_offset`) so each step costs O(window), and holds back
    text ending in an incomplete UTF-8 character (U+FFFD) until the next token completes it.
    Stop strings are the engine's (engine/stopping.py): it may cut `text` short.
    """

    tokenizer: PreTrainedTokenizerBase
    skip_special_tokens: bool = True
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0

    def add(self, token_ids: list[int]) -> None:
        """Append tokens, and to `text` whatever text they complete."""
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
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.text += full[len(prefix) :]
