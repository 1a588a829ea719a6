"""Built-in model presets, written as the config.json fields they come from.

Each preset is the subset of a public Hugging Face config.json that the planner reads, under
the same field names, and goes through the same reader as a user's config.json.  The comment
above each names the repository whose config.json the values were taken from.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any


@dataclass(frozen=True)
class Preset:
    """A named model and the config.json values it was written from."""

    name: str  # what users type: "llama-2-70b"
    title: str  # "Llama 2 70B"
    hf_id: str  # the source repository, also accepted as a name
    config: Mapping[str, Any]


def _preset(name: str, title: str, hf_id: str, **config: Any) -> Preset:
    return Preset(name, title, hf_id, MappingProxyType(config))


def _llama(hidden: int, inter: int, layers: int, heads: int, kv: int, **rest: Any) -> dict:
    """The config.json fields shared by Llama-style dense models."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "tie_word_embeddings": False,
        **rest,
    }  # fmt: skip


# The plain Llama presets, one row each, from their repositories' config.json: name (whose
# title case is the title), Hugging Face id, hidden_size, intermediate_size,
# num_hidden_layers, num_attention_heads, num_key_value_heads (GQA when fewer than heads),
# vocab_size, max_position_embeddings, torch_dtype (bf16: bfloat16, f16: float16).
_DTYPES = {"bf16": "bfloat16", "f16": "float16"}
_LLAMA_ROWS = (
    ("llama-2-7b", "meta-llama/Llama-2-7b-hf", 4096, 11008, 32, 32, 32, 32000, 4096, "f16"),
    ("llama-2-13b", "meta-llama/Llama-2-13b-hf", 5120, 13824, 40, 40, 40, 32000, 4096, "f16"),
    ("llama-2-70b", "meta-llama/Llama-2-70b-hf", 8192, 28672, 80, 64, 8, 32000, 4096, "f16"),
    ("llama-3.1-8b", "meta-llama/Llama-3.1-8B", 4096, 14336, 32, 32, 8, 128256, 131072, "bf16"),
    ("llama-3.1-70b", "meta-llama/Llama-3.1-70B", 8192, 28672, 80, 64, 8, 128256, 131072, "bf16"),
    ("llama-3.1-405b", "meta-llama/Llama-3.1-405B", 16384, 53248, 126, 128, 8, 128256, 131072, "bf16"),  # noqa: E501
)  # fmt: skip


def _llama_preset(name: str, hf_id: str, *sizes: int, torch_dtype: str) -> Preset:
    *shape, vocab, context = sizes
    title = name.replace("-", " ").title()  # llama-3.1-8b -> Llama 3.1 8B
    return _preset(name, title, hf_id, **_llama(*shape, vocab_size=vocab,
                   max_position_embeddings=context, torch_dtype=torch_dtype))  # fmt: skip


PRESETS: tuple[Preset, ...] = (
    *(_llama_preset(*row[:-1], torch_dtype=_DTYPES[row[-1]]) for row in _LLAMA_ROWS),
    # mistralai/Mistral-7B-v0.1 config.json: the Llama fields plus sliding_window (every layer)
    _preset("mistral-7b", "Mistral 7B v0.1", "mistralai/Mistral-7B-v0.1",
            **_llama(4096, 14336, 32, 32, 8, vocab_size=32000, max_position_embeddings=32768,
                     torch_dtype="bfloat16", sliding_window=4096,
                     architectures=["MistralForCausalLM"], model_type="mistral")),
    # mistralai/Mixtral-8x7B-v0.1 config.json: the Llama fields plus num_local_experts,
    # num_experts_per_tok (each expert an MLP of intermediate_size); sliding_window is null
    _preset("mixtral-8x7b", "Mixtral 8x7B", "mistralai/Mixtral-8x7B-v0.1",
            **_llama(4096, 14336, 32, 32, 8, vocab_size=32000, max_position_embeddings=32768,
                     torch_dtype="bfloat16", sliding_window=None, num_local_experts=8,
                     num_experts_per_tok=2, architectures=["MixtralForCausalLM"],
                     model_type="mixtral")),
    # Qwen/Qwen2.5-7B-Instruct config.json: the Llama fields plus sliding_window with
    # use_sliding_window false (so no layer slides); model_type qwen2 implies the q/k/v bias
    _preset("qwen2.5-7b", "Qwen2.5 7B Instruct", "Qwen/Qwen2.5-7B-Instruct",
            **_llama(3584, 18944, 28, 28, 4, vocab_size=152064, max_position_embeddings=32768,
                     torch_dtype="bfloat16", sliding_window=131072, use_sliding_window=False,
                     architectures=["Qwen2ForCausalLM"], model_type="qwen2")),
    # Qwen/Qwen2.5-72B-Instruct config.json (same fields)
    _preset("qwen2.5-72b", "Qwen2.5 72B Instruct", "Qwen/Qwen2.5-72B-Instruct",
            **_llama(8192, 29568, 80, 64, 8, vocab_size=152064, max_position_embeddings=32768,
                     torch_dtype="bfloat16", sliding_window=131072, use_sliding_window=False,
                     architectures=["Qwen2ForCausalLM"], model_type="qwen2")),
    # google/gemma-2-27b-it config.json: head_dim is explicit (32 x 128 != hidden_size),
    # embeddings are tied, and model_type gemma2 alternates sliding (even) and global layers
    _preset("gemma-2-27b", "Gemma 2 27B", "google/gemma-2-27b-it",
            **_llama(4608, 36864, 46, 32, 16, head_dim=128, vocab_size=256000,
                     max_position_embeddings=8192, torch_dtype="bfloat16", sliding_window=4096,
                     tie_word_embeddings=True, architectures=["Gemma2ForCausalLM"],
                     model_type="gemma2")),
    # deepseek-ai/DeepSeek-V3 config.json: MLA (q_lora_rank, kv_lora_rank, qk_nope_head_dim,
    # qk_rope_head_dim, v_head_dim), MoE (n_routed_experts, n_shared_experts,
    # num_experts_per_tok, moe_intermediate_size, first_k_dense_replace) and fp8 weights
    # (quantization_config.quant_method).  The multi-token-prediction layer is not counted.
    _preset("deepseek-v3", "DeepSeek-V3", "deepseek-ai/DeepSeek-V3",
            architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
            hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
            num_hidden_layers=61, first_k_dense_replace=3, num_attention_heads=128,
            num_key_value_heads=128, n_routed_experts=256, n_shared_experts=1,
            num_experts_per_tok=8, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
            qk_rope_head_dim=64, v_head_dim=128, vocab_size=129280,
            max_position_embeddings=163840, torch_dtype="bfloat16", tie_word_embeddings=False,
            quantization_config={"quant_method": "fp8", "fmt": "e4m3",
                                 "weight_block_size": [128, 128]}),
    # HuggingFaceTB/SmolLM2-135M-Instruct config.json: the engine's embedded default model
    _preset("smollm2-135m", "SmolLM2 135M Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct",
            **_llama(576, 1536, 30, 9, 3, vocab_size=49152, max_position_embeddings=8192,
                     torch_dtype="bfloat16", tie_word_embeddings=True)),
)  # fmt: skip


def preset_names() -> list[str]:
    return [preset.name for preset in PRESETS]


def _normalize(name: str) -> str:
    return re.sub(r"[\s_]+", "-", name.strip().lower())


def find_preset(name: str) -> Preset | None:
    """Look a preset up by its name or its Hugging Face id, ignoring case; None if unknown."""
    wanted = _normalize(name)
    for preset in PRESETS:
        if wanted in (preset.name, _normalize(preset.hf_id)):
            return preset
    return None
