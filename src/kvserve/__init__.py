"""kvserve: a KV-cache-efficient LLM inference server."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvserve.request import SamplingParams

if TYPE_CHECKING:
    from kvserve.llm import LLM

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    # LLM pulls in torch and transformers; import it only when asked for.
    if name == "LLM":
        from kvserve.llm import LLM

        return LLM
    raise AttributeError(name)
