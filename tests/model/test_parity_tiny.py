"""Tiny random-weight Llama 3 (rope scaling), Qwen2 (QKV bias, tied) and Mistral models:
our loader + model + paged attention against Hugging Face transformers on the same weights."""

from __future__ import annotations

import pytest
import torch
from helpers import hf_greedy, run_in_chunks

from kvserve import LLM, SamplingParams
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.loader import load_checkpoint

ARCHS = ["llama3", "qwen2", "mistral"]
PROMPT = [1, 504, 3224, 282, 4649, 314, 5483, 30, 2] + list(range(1000, 1130, 3))  # 53 tokens


def our_model(directory):
    ckpt = load_checkpoint(str(directory))
    return LlamaForCausalLM.from_weights(
        ckpt.config, ckpt.weights, torch.float32, torch.device("cpu")
    )


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(tiny_model_dir, arch):
    directory, hf = tiny_model_dir(arch)
    ours = run_in_chunks(our_model(directory), PROMPT, chunk_size=len(PROMPT))
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0]
    # float32 end to end; observed differences are ~1e-6.
    assert (ours - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_match_transformers(tiny_model_dir, arch):
    directory, hf = tiny_model_dir(arch)
    llm = LLM(str(directory), kv_cache_memory=4 * 2**20, max_model_len=256, dtype="float32")
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    assert out[0].outputs[0].token_ids == hf_greedy(hf, PROMPT, 32)


def test_model_config_read_from_config_json(tiny_model_dir):
    directory, _ = tiny_model_dir("llama3")
    config = load_checkpoint(str(directory)).config
    assert config.architecture == "llama"
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (
        2,
        4,
        2,
        16,
    )
    assert config.rope_scaling["rope_type"] == "llama3"
    assert config.rope_theta == 500000.0
    qwen = load_checkpoint(str(tiny_model_dir("qwen2")[0])).config
    assert qwen.attention_bias and qwen.tie_word_embeddings
