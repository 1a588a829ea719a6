"""Shared fixtures: tiny random-weight Hugging Face models of each supported architecture.

Each is saved with save_pretrained (safetensors) next to the embedded model's tokenizer, so
kvserve loads it exactly as it would a real checkpoint directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# The engine compiles its layers with torch.compile by default; the suite runs them eagerly
# (and tests/model/test_fast_paths.py compares the two), which saves seconds per engine start.
os.environ.setdefault("KVSERVE_ENFORCE_EAGER", "1")
# --weight-dtype auto gives the embedded (Q4_1) model int8 weights for decode steps on a
# float32 CPU; the suite's parity tests compare its float weights with transformers' and
# llama.cpp's, so it runs float weights unless a test asks (tests/model/test_int8_weights.py).
os.environ.setdefault("KVSERVE_WEIGHT_DTYPE", "float")

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    vocab_size=49152,
    rms_norm_eps=1e-5,
)


def tiny_hf_config(arch: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    if arch == "llama3":
        rope = {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
            "rope_theta": 500000.0,
        }  # fmt: skip
        return LlamaConfig(
            **TINY, rope_scaling=rope, rope_theta=500000.0, tie_word_embeddings=False
        )
    if arch == "qwen2":
        return Qwen2Config(**TINY, tie_word_embeddings=True, rope_theta=1e6)
    if arch == "mistral":
        return MistralConfig(**TINY, sliding_window=None, tie_word_embeddings=False)
    raise ValueError(arch)


@pytest.fixture(scope="session")
def embedded_tokenizer():
    from kvserve.models.loader import embedded_model_path
    from kvserve.tokenizer import load_tokenizer

    return load_tokenizer(embedded_model_path())


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, embedded_tokenizer):
    """factory: arch -> (directory, HF model in float32 eval mode).

    `initializer_range` (transformers' default 0.02) scales the random weights: at 0.02 the
    logits stay below 1 and attention is nearly uniform, so position errors (RoPE) barely move
    the logits; 0.1 gives sharp attention, which a bfloat16 comparison needs to see them."""
    from transformers import AutoModelForCausalLM

    made: dict[tuple[str, float | None], tuple[Path, torch.nn.Module]] = {}

    def make(arch: str, initializer_range: float | None = None) -> tuple[Path, torch.nn.Module]:
        key = (arch, initializer_range)
        if key not in made:
            config = tiny_hf_config(arch)
            if initializer_range is not None:
                config.initializer_range = initializer_range
            torch.manual_seed(1234)
            model = AutoModelForCausalLM.from_config(config).float().eval()
            directory = tmp_path_factory.mktemp(f"tiny-{arch}")
            model.save_pretrained(directory)
            embedded_tokenizer.save_pretrained(directory)
            made[key] = (directory, model)
        return made[key]

    return make
