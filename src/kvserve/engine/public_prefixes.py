"""--public-prefixes FILE: prompt starts shared by every tenant whatever its cache_salt.

The file holds either one text per line, or a JSON list whose items are

    "text"                                   the exact text a prompt starts with
    {"role": "system", "content": "..."}     a chat message, rendered by the model's chat
    [{"role": ...}, ...]                     template (the messages a conversation starts with)

Each entry is tokenized once at start-up.  A text is tokenized as /v1/completions tokenizes a
prompt (with and without the tokenizer's special tokens, when they differ); messages are
rendered by the chat template without a generation prompt and tokenized as /v1/chat/completions
tokenizes the whole conversation, so a chat request whose first messages are these starts with
exactly these tokens.  The KV cache manager keys a block without the salt when its tokens lie
entirely inside one of these token prefixes (kv/block_hasher.py).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from kvserve.errors import ParameterError

logger = logging.getLogger("kvserve")
FLAG = "--public-prefixes"


def read_entries(path: str) -> list[str | list[dict[str, Any]]]:
    """The file's entries: texts, or lists of chat messages.  ParameterError names the flag."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ParameterError(FLAG, f"cannot read {path}: {exc.strerror or exc}") from None
    if not text.lstrip().startswith("["):
        return [line for line in text.splitlines() if line.strip()]
    try:
        items = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ParameterError(
            FLAG, f"{path} starts with '[' but is not a JSON list ({exc})"
        ) from None
    return [_entry(item, i) for i, item in enumerate(items)]


def _entry(item: Any, index: int) -> str | list[dict[str, Any]]:
    if isinstance(item, str) and item:
        return item
    messages = [item] if isinstance(item, dict) else item
    if isinstance(messages, list) and messages and all(_is_message(m) for m in messages):
        return messages
    raise ParameterError(
        FLAG, f"item {index} must be a non-empty text, a chat message or a list of them"
    )


def _is_message(item: Any) -> bool:
    return isinstance(item, dict) and isinstance(item.get("role"), str) and "content" in item


def public_prefix_token_ids(path: str, tokenizer: Any) -> list[list[int]]:
    """Token-id prefixes of the file's entries (a text may give two: with and without the
    tokenizer's special tokens)."""
    prefixes: list[list[int]] = []
    for entry in read_entries(path):
        if isinstance(entry, str):
            variants = [tokenizer.encode(entry), tokenizer.encode(entry, add_special_tokens=False)]
        else:
            rendered = _render(tokenizer, entry)
            variants = [tokenizer.encode(rendered, add_special_tokens=False)]
        for ids in variants:
            if ids and ids not in prefixes:
                prefixes.append(ids)
    logger.info("public prefixes: %d token prefixes from %s (%s tokens)", len(prefixes), path,
                ", ".join(str(len(p)) for p in prefixes))  # fmt: skip
    return prefixes


def _render(tokenizer: Any, messages: list[dict[str, Any]]) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise ParameterError(FLAG, "holds chat messages, but this model has no chat template")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    except Exception as exc:  # noqa: BLE001 - jinja rejects some roles and orders
        raise ParameterError(FLAG, f"the chat template rejected {messages!r:.80}: {exc}") from None
