"""The flex backend on the embedded SmolLM2-135M in float32: the same greedy tokens as the
PyTorch reference, through chunked prefills (cached context in the prefill call), a
prefix-cache hit and batched decodes.  (Every KV dtype is compared call by call in
tests/unit/test_flex_attention.py.)"""

from __future__ import annotations

from kvserve import LLM, SamplingParams
from kvserve.attention.flex import FlexAttentionBackend
from kvserve.attention.torch_ref import TorchRefBackend

SYSTEM = "<|im_start|>system\nYou are a concise assistant who answers in one sentence.<|im_end|>\n"
PROMPTS = [
    SYSTEM + "<|im_start|>user\nWhat is a KV cache?<|im_end|>\n<|im_start|>assistant\n",
    SYSTEM + "<|im_start|>user\nName a prime number.<|im_end|>\n<|im_start|>assistant\n",
    "The capital of France is",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def greedy_tokens(llm: LLM) -> tuple[list[list[int]], int]:
    """The first prompt alone (two 16-token chunks), then the others: the second chat prompt
    hits the first one's cached system-prompt block.  Returns tokens and prefix-hit tokens."""
    hits_before = llm.engine.get_stats().prefix_cache_hits
    first = llm.generate(PROMPTS[:1], GREEDY)
    rest = llm.generate(PROMPTS[1:], GREEDY)
    tokens = [o.outputs[0].token_ids for o in first + rest]
    return tokens, llm.engine.get_stats().prefix_cache_hits - hits_before


def test_flex_gives_the_reference_greedy_tokens(embedded_tokenizer):
    assert len(embedded_tokenizer.encode(PROMPTS[0])) > 16  # chunked: context in a prefill
    llm = LLM(
        kv_cache_memory=16 * 2**20,
        max_model_len=256,
        dtype="float32",
        attention_backend="flex",
        enable_prefix_caching=True,
        max_num_batched_tokens=16,
    )
    assert isinstance(llm.engine.executor.driver_worker.runner.backend, FlexAttentionBackend)
    flex, flex_hits = greedy_tokens(llm)
    # The same engine with the reference backend (one model load instead of two: seconds).
    llm.engine.reset_prefix_cache()
    llm.engine.executor.driver_worker.runner.backend = TorchRefBackend()
    reference, reference_hits = greedy_tokens(llm)
    assert flex == reference
    assert flex_hits == reference_hits >= 16  # the cached system prompt was read
    assert all(len(t) == 4 for t in flex)
