"""Tokenization for the HTTP side: off the event loop, never sharing a tokenizer between threads.

Encoding a 16 MiB body takes seconds, and chat templating runs Jinja in Python: on the event
loop either would stall every stream and /health.  So they run on a small thread pool.  A
Hugging Face fast tokenizer is not safe to use from two threads at once (its Rust core may be
borrowed mutably while encoding), and the engine thread detokenizes with its own instance; so
each pool thread gets a private copy, taken from a pristine copy made before the engine thread
starts, and the event loop has one more copy for the short decodes it does itself (one token's
text for logprobs).  HF's encode goes through `encode_batch`, which releases the GIL while the
Rust code runs, so the loop keeps answering during a long encode.
"""

from __future__ import annotations

import asyncio
import copy
import queue
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvserve.server.tools import for_template
from kvserve.tokenizer import apply_chat_template

T = TypeVar("T")
NUM_TOKENIZER_THREADS = 2


class ServerTokenizers:
    """Private tokenizer copies: one for the event loop, one per pool thread."""

    def __init__(self, tokenizer: Any, num_threads: int = NUM_TOKENIZER_THREADS) -> None:
        """Call before the engine thread starts using `tokenizer` (copying reads it)."""
        self.loop_tokenizer = copy.deepcopy(tokenizer)
        self._idle: queue.SimpleQueue[Any] = queue.SimpleQueue()
        for _ in range(num_threads):  # as many copies as threads: taking one never blocks
            self._idle.put(copy.deepcopy(tokenizer))
        self._executor = ThreadPoolExecutor(num_threads, thread_name_prefix="kvserve-tokenize")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(tokenizer, *args)` on a pool thread with a tokenizer no other thread uses."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._with_tokenizer, fn, args)

    def _with_tokenizer(self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        tokenizer = self._idle.get()
        try:
            return fn(tokenizer, *args)
        finally:
            self._idle.put(tokenizer)

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self.run(_encode, text, add_special_tokens)

    async def decode(self, token_ids: list[int]) -> str:
        return await self.run(_decode, token_ids)

    async def chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        return await self.run(_chat, messages, tools)

    async def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str]:
        return await self.run(_convert_ids_to_tokens, token_ids)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _chat(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[int]:
    """The chat template, with tools rendered by kvserve where it ignores them (tools.py)."""
    template = tokenizer.chat_template
    if isinstance(template, str):
        messages, tools = for_template(template, messages, tools)
    return apply_chat_template(tokenizer, messages, tools)


def _encode(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def _decode(tokenizer: Any, token_ids: list[int]) -> str:
    return tokenizer.decode(token_ids)


def _convert_ids_to_tokens(tokenizer: Any, token_ids: list[int]) -> list[str]:
    return tokenizer.convert_ids_to_tokens(token_ids)
