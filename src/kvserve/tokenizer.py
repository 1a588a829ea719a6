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

from tokenizers.decoders import DecodeStream
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from kvserve.config import cache_dir
from kvserve.errors import UserInputError

# Tokens before the first undecoded one that a window starts from after the stream fails:
# enough context for a tokenizer's merges and spaces around it.
_WINDOW_BEFORE = 5


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
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Token ids of a conversation with the assistant's turn opened; `tools` (OpenAI's
    function definitions) go to the template as Hugging Face templates expect them."""
    if not tokenizer.chat_template:
        raise UserInputError("this model has no chat template; use /v1/completions")
    text = tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    return tokenizer.encode(text, add_special_tokens=False)


def _decode_stream(tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool) -> Any:
    """The tokenizers library's own incremental decoder for this tokenizer, or None where it
    would not give transformers' text: no fast (Rust) tokenizer behind it, or transformers
    cleans up spaces after decoding (the stream does not)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    return DecodeStream(skip_special_tokens=skip_special_tokens)


@dataclass
class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text as they arrive.

    With a fast tokenizer, through the tokenizers library's DecodeStream: one call into Rust a
    token (~1 us) instead of two transformers decodes of a window (~5 us; 128 of them in each
    of W1's decode steps).  Otherwise, and after the stream fails, it decodes a short window
    (from `prefix_offset`) so each step costs O(window).  Both hold back text ending in an
    incomplete UTF-8 character until the next token completes it.  Stop strings are the
    engine's (engine/stopping.py): it may cut `text` short.
    """

    tokenizer: PreTrainedTokenizerBase
    skip_special_tokens: bool = True
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    _stream: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self._stream = _decode_stream(self.tokenizer, self.skip_special_tokens)

    def add(self, token_ids: list[int]) -> None:
        """Append tokens, and to `text` whatever text they complete."""
        if self._stream is not None:
            self._add_streamed(token_ids)
            return
        self.token_ids.extend(token_ids)
        self._add_windowed()

    def _add_streamed(self, token_ids: list[int]) -> None:
        backend = self.tokenizer.backend_tokenizer
        for index, token_id in enumerate(token_ids):
            try:
                piece = self._stream.step(backend, token_id)
            except Exception:  # noqa: BLE001 - the stream gave up: decode windows from here
                self._stream = None
                self.read_offset = len(self.token_ids)
                self.prefix_offset = max(self.read_offset - _WINDOW_BEFORE, 0)
                self.token_ids.extend(token_ids[index:])
                self._add_windowed()
                return
            self.token_ids.append(token_id)
            if piece:
                self.text += piece

    def _add_windowed(self) -> None:
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
