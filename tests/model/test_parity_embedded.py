"""The embedded SmolLM2-135M (Q4_1 GGUF) against Hugging Face transformers' Llama loaded from
the same file by transformers' own GGUF reader (its own dequantization and Q/K un-permute):
an independent check of our loader as well as our model."""

from __future__ import annotations

import pytest
import torch
from helpers import hf_greedy, run_in_chunks

from kvserve import LLM, SamplingParams
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.loader import embedded_model_path, load_checkpoint

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "<|im_start|>user\nWhat is a KV cache?<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village by the sea, there lived",
]


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    path = embedded_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def ours():
    ckpt = load_checkpoint(None)
    return LlamaForCausalLM.from_weights(
        ckpt.config, ckpt.weights, torch.float32, torch.device("cpu")
    )


def test_logits_match_transformers(hf_model, ours, embedded_tokenizer):
    for prompt in PROMPTS:
        ids = embedded_tokenizer.encode(prompt)
        mine = run_in_chunks(ours, ids, chunk_size=len(ids), block_size=16)
        with torch.no_grad():
            ref = hf_model(torch.tensor([ids])).logits[0]
        # Same float32 weights; differences come from summation order only (seen: ~2e-5).
        assert (mine - ref).abs().max().item() < 2e-3, prompt


def test_40_greedy_tokens_match_transformers(hf_model, embedded_tokenizer):
    # Eager: the reference layers (compiling them cost ~17 s of this test; compiled against
    # eager is tests/model/test_fast_paths.py, bf16's served path tests/model/test_bf16.py).
    # 40 tokens: 64 took 34 s of a suite at its 12-minute limit, most of it transformers' steps.
    llm = LLM(kv_cache_memory=64 * 2**20, max_model_len=1024, dtype="float32", enforce_eager=True)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        ids = embedded_tokenizer.encode(prompt)
        assert out.outputs[0].token_ids == hf_greedy(hf_model, ids, 40), prompt
