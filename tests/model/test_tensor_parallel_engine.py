"""The whole engine with --tensor-parallel-size 2 (a worker process, gloo) against one rank:
the features that live outside the model (8-bit KV, preemption under a tiny cache, the host
tier, n > 1, prefix caching) work unchanged, with the same greedy tokens.

Tiny random Llama (tests/conftest.py: 4 query / 2 KV heads, so 2 + 1 per rank), float32;
the device cache holds 12 blocks of 16 tokens: two requests growing to 9 blocks each preempt."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.planner.layers import kv_layout
from kvserve.planner.plan import engine_kv_capacity, kv_capacity
from kvserve.planner.readers import load_model_shape

BLOCK = 16
A = [(i * 7919) % 40000 + 7 for i in range(60)]
B = [(i * 104729) % 40000 + 11 for i in range(60)]


def make(directory: str, tensor_parallel_size: int) -> LLM:
    # int8: 2 KV heads x 16 dims x (1 byte + 4 scale bytes / 16 dims) x 2 x 2 layers per
    # token on one rank; the KV budget is sized for 12 blocks of it (per rank with TP 2)
    per_token = 2 * 2 * 2 * (16 + 4) // tensor_parallel_size
    return LLM(
        directory, dtype="float32", block_size=BLOCK, max_model_len=12 * BLOCK,
        kv_cache_dtype="int8", kv_cache_dtype_check="off",
        kv_cache_memory=12 * BLOCK * per_token, kv_offloading_size=2**-10,
        tensor_parallel_size=tensor_parallel_size,
    )  # fmt: skip


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_dir):
    return str(tiny_model_dir("llama3", 0.1)[0])


def run(llm: LLM):  # noqa: ANN201 - (token lists, SchedulerStats)
    greedy = SamplingParams(temperature=0.0, max_tokens=70, ignore_eos=True)
    outputs = llm.generate([A, B], greedy)
    pair = llm.generate([A[:40]], SamplingParams(temperature=0.0, max_tokens=4, n=2))[0]
    tokens = [o.outputs[0].token_ids for o in outputs] + [c.token_ids for c in pair.outputs]
    return tokens, llm.engine.get_stats()


def test_tp2_engine_equals_one_rank_with_int8_preemption_host_tier_and_n2(tiny_dir):
    one = make(tiny_dir, 1)
    assert one.engine.sizing.num_blocks == 12
    reference, one_stats = run(one)
    two = make(tiny_dir, 2)
    try:
        assert two.engine.sizing.num_blocks == 12
        sizing = two.engine.sizing
        assert (sizing.spec.num_kv_heads, sizing.spec.dtype) == (1, "int8")  # per rank
        # the planner counts the same per-rank bytes, blocks and concurrency
        budget = 12 * BLOCK * 80
        planned = kv_capacity(kv_layout(load_model_shape(tiny_dir), "int8", BLOCK, 2), budget,
                              12 * BLOCK)  # fmt: skip
        assert planned == engine_kv_capacity(
            2,
            2,
            16,
            "float32",
            block_size=BLOCK,
            kv_cache_dtype="int8",
            kv_cache_memory=budget,
            max_model_len=12 * BLOCK,
            tensor_parallel_size=2,
        )
        assert (
            (planned.bytes_per_token, planned.num_blocks, planned.max_concurrency)
            == (sizing.spec.bytes_per_token, sizing.num_blocks, sizing.max_concurrency)
            == (80, 12, 1.0)
        )
        tokens, stats = run(two)
        assert tokens == reference
        assert stats.num_preemptions == one_stats.num_preemptions >= 1
        # the preempted request resumed from blocks the host tier kept, on every rank
        assert stats.prefix_cache_host_hits == one_stats.prefix_cache_host_hits > 0
        assert stats.prefix_cache_hits == one_stats.prefix_cache_hits >= 32
    finally:
        two.engine.close()
