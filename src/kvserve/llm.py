"""Offline batch generation: ``LLM(model).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

from kvserve.config import ENGINE_PARTS, EngineConfig, LoadConfig
from kvserve.engine.gc_freeze import heap_frozen
from kvserve.engine.llm_engine import LLMEngine
from kvserve.request import RequestOutputKind, SamplingParams
from kvserve.step import RequestOutput


def engine_config_from_kwargs(model: str | None = None, **kwargs: Any) -> EngineConfig:
    """Split vLLM-style keyword arguments (max_model_len=..., block_size=...) into the parts."""
    parts = {}
    for name, cls in ENGINE_PARTS:
        names = {f.name for f in fields(cls)}
        parts[name] = cls(**{k: kwargs.pop(k) for k in list(kwargs) if k in names})
    if kwargs:
        raise TypeError(f"unknown engine arguments: {', '.join(sorted(kwargs))}")
    if model is not None:
        parts["load"] = LoadConfig(**{**parts["load"].__dict__, "model": model})
    return EngineConfig(**parts)


class LLM:
    """Runs the engine to completion over a list of prompts; outputs in prompt order."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine = LLMEngine(engine_config_from_kwargs(model, **kwargs))

    @classmethod
    def from_engine_config(cls, config: EngineConfig) -> LLM:
        llm = cls.__new__(cls)
        llm.engine = LLMEngine(config)
        return llm

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = sampling_params or SamplingParams()
        param_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(param_list) != len(prompts):
            raise ValueError("sampling_params must be one value or one per prompt")
        ids = []
        for i, (prompt, p) in enumerate(zip(prompts, param_list, strict=True)):
            request_id = f"offline-{id(self)}-{i}"
            # only the final output is read: no copy of every sequence at every step
            final_only = replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
            self.engine.add_request(request_id, prompt, final_only)
            ids.append(request_id)
        finished: dict[str, RequestOutput] = {}
        with heap_frozen():  # no collection walks the engine's own objects (gc_freeze.py)
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
        return [finished[i] for i in ids]

    def chat(
        self, messages: list[dict[str, str]], sampling_params: SamplingParams | None = None
    ) -> RequestOutput:
        from kvserve.tokenizer import apply_chat_template

        token_ids = apply_chat_template(self.engine.tokenizer, messages)
        return self.generate([token_ids], sampling_params)[0]
