"""Tiny random-weight models of the windowed architectures (Qwen3, Gemma 3 text, Mistral with
a sliding window) and transformers' greedy tokens for them, shared by the model tests
(tests/model/conftest.py makes them fixtures)."""

from __future__ import annotations

import pytest
import torch
from helpers import hf_greedy

WINDOW = 48
NEW_TOKENS = 64
VOCAB = 49152  # the embedded model's tokenizer, saved next to the weights
PROMPT = [(i * 7919 + 13) % 40000 + 7 for i in range(200)]  # > 4 windows
COMMON = dict(
    hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=1024, vocab_size=VOCAB, initializer_range=0.1,
)  # fmt: skip


def hf_config(arch: str):
    from transformers import Gemma3TextConfig, MistralConfig, Qwen3Config

    if arch == "qwen3":  # layer 0 full, layer 1 sliding; head_dim 32 != 64 / 4
        return Qwen3Config(**COMMON, num_hidden_layers=2, head_dim=32, use_sliding_window=True,
                           sliding_window=WINDOW, max_window_layers=1, rope_theta=1e6,
                           tie_word_embeddings=False)  # fmt: skip
    if arch == "gemma3":  # the default pattern: layers 0-4 local, 5 global
        return Gemma3TextConfig(
            **COMMON, num_hidden_layers=6, head_dim=32, sliding_window=WINDOW,
            query_pre_attn_scalar=24, rope_theta=1e6, rope_local_base_freq=10000.0,
            rope_scaling={"rope_type": "linear", "factor": 4.0},
        )  # fmt: skip
    if arch == "mistral":
        return MistralConfig(**COMMON, num_hidden_layers=2, sliding_window=WINDOW,
                             tie_word_embeddings=False)  # fmt: skip
    raise ValueError(arch)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, embedded_tokenizer):
    """arch -> (directory, transformers model in float32 eval mode)."""
    from transformers import AutoModelForCausalLM

    made = {}

    def make(arch: str):
        if arch not in made:
            torch.manual_seed(4321)
            model = AutoModelForCausalLM.from_config(hf_config(arch)).float().eval()
            with torch.no_grad():  # random norm weights (Gemma's start at 0, the others' at 1)
                for name, param in model.named_parameters():
                    if "norm" in name:
                        param.add_(torch.randn_like(param) * 0.2)
            directory = tmp_path_factory.mktemp(f"tiny-{arch}")
            model.save_pretrained(directory)
            embedded_tokenizer.save_pretrained(directory)
            made[arch] = (directory, model)
        return made[arch]

    return make


@pytest.fixture(scope="module")
def reference(tiny):
    """arch -> transformers' greedy tokens for PROMPT (computed once)."""
    tokens = {}

    def greedy(arch: str) -> list[int]:
        if arch not in tokens:
            tokens[arch] = hf_greedy(tiny(arch)[1], PROMPT, NEW_TOKENS)
        return tokens[arch]

    return greedy
