"""The whole engine with --tensor-parallel-size 2 (a worker process, gloo) against one rank:
the features that live outside the model (8-bit KV, preemption under a tiny cache, the host
tier, n > 1, prefix caching) work unchanged, with the same greedy tokens; so do the Worker's
start-up features (the KV dtype check, the layers' path: torch.compile with N ranks, the
native path with one), and --prefix-cache-dir (a store of two ranks is one rank's).

Tiny random Llama (tests/conftest.py: 4 query / 2 KV heads, so 2 + 1 per rank), float32;
the device cache holds 12 blocks of 16 tokens: two requests growing to 9 blocks each preempt.
The embedded model in bfloat16 for the native path's comparison."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.models.native_layers import native_kernels
from kvserve.models.packed_linear import can_pack
from kvserve.planner.layers import kv_layout
from kvserve.planner.plan import engine_kv_capacity, kv_capacity
from kvserve.planner.readers import load_model_shape
from kvserve.runner.disk_tier import block_file

BLOCK = 16
A = [(i * 7919) % 40000 + 7 for i in range(60)]
B = [(i * 104729) % 40000 + 11 for i in range(60)]


def make(directory: str, tensor_parallel_size: int, **kw) -> LLM:
    # int8: 2 KV heads x 16 dims x (1 byte + 4 scale bytes / 16 dims) x 2 x 2 layers per
    # token on one rank; the KV budget is sized for 12 blocks of it (per rank with TP 2)
    per_token = 2 * 2 * 2 * (16 + 4) // tensor_parallel_size
    return LLM(
        directory, dtype="float32", block_size=BLOCK, max_model_len=12 * BLOCK,
        kv_cache_dtype="int8", kv_cache_dtype_check="off",
        kv_cache_memory=12 * BLOCK * per_token, kv_offloading_size=2**-10,
        tensor_parallel_size=tensor_parallel_size, **kw,
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


# Clear greedy choices: one rank's top-1 logit leads the next by >= 0.75 at each of these
# prompts' first 5 tokens (the embedded model in bfloat16, eager, int8 KV).  bfloat16 ranks
# round their o_proj / down_proj partial sums before the all-reduce, where one rank rounds the
# whole sum once: a longer generation may part from one rank's at a near-tie.
BF16_PROMPTS = ["1, 2, 3, 4, 5,", "Q: What is 2 + 2?\nA:", "The chemical symbol for gold is",
                "The capital of France is"]  # fmt: skip


def native_path_serves_bfloat16() -> bool:
    """This CPU has the layers' native path (bfloat16 packing and an AMX or AVX512-BF16
    build of csrc/decode_layer.c)."""
    return can_pack(torch.device("cpu"), torch.bfloat16) and native_kernels() is not None


def test_tp2_bfloat16_checks_the_kv_dtype_and_equals_one_rank_on_the_native_path(caplog):
    """As `kvserve serve` runs (not eager) where this CPU has the native path: one rank takes
    it, two ranks refuse it (executor/base.py) and compile their layers; both ranks run the
    int8 KV dtype check, and the greedy tokens equal one rank's.  Without the native path both
    run eagerly (a compile of the embedded model would cost minutes on a small machine)."""
    eager = not native_path_serves_bfloat16()

    def make(tensor_parallel_size: int, **kw) -> LLM:
        return LLM(dtype="bfloat16", kv_cache_dtype="int8", kv_cache_memory=8 * 2**20,
                   max_model_len=256, enable_prefix_caching=False, enforce_eager=eager,
                   tensor_parallel_size=tensor_parallel_size, **kw)  # fmt: skip

    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    one = make(1, kv_cache_dtype_check="off")
    assert (one.engine.executor.driver_worker.model.native_layers is None) == eager
    reference = [o.outputs[0].token_ids for o in one.generate(BF16_PROMPTS, greedy)]
    with caplog.at_level(logging.INFO, logger="kvserve"):
        two = make(2)  # --kv-cache-dtype-check refuse, the default
    try:
        checks = [m for m in caplog.messages if m.startswith("KV cache dtype check: int8 vs ")]
        assert len(checks) == 1 and checks[0].endswith(": pass")  # rank 0's line
        assert two.engine.sizing.spec.dtype == "int8"
        if not eager:
            assert "tensor parallel: no native layers" in caplog.text
            assert "compiled the layers with torch.compile" in caplog.text
        assert [o.outputs[0].token_ids for o in two.generate(BF16_PROMPTS, greedy)] == reference
    finally:
        two.engine.close()


def test_tp2_compiles_the_layers_on_every_rank(tiny_dir, caplog):
    """Not eager: every rank compiles its layers (after every rank showed it can compile),
    with one rank's eager tokens (float32: compiled and eager layers agree)."""
    one = make(tiny_dir, 1)
    reference, _ = run(one)
    with caplog.at_level(logging.INFO, logger="kvserve"):
        two = make(tiny_dir, 2, enforce_eager=False)
    try:
        assert "compiled the layers with torch.compile" in caplog.text
        assert two.engine.executor.driver_worker.model.native_layers is None
        assert run(two)[0] == reference
    finally:
        two.engine.close()


def test_prefix_store_of_two_ranks_is_one_ranks_store(tiny_dir, tmp_path):
    """--prefix-cache-dir with 2 ranks: a stored block holds every rank's KV heads (and the
    int8 scales), so a store written by two ranks loads on one and one's loads on two, each
    with the whole prompt but its partial block cached and the same greedy tokens."""
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def served(tensor_parallel_size: int, prompts: list[list[int]]):  # noqa: ANN202
        llm = make(tiny_dir, tensor_parallel_size, prefix_cache_dir=str(tmp_path))
        try:
            return llm.generate(prompts, greedy)
        finally:
            llm.engine.close()  # writes the store

    fresh_a = served(2, [A])[0]
    again_a, fresh_b = served(1, [A, B])
    assert again_a.num_cached_tokens == (len(A) - 1) // BLOCK * BLOCK
    assert again_a.outputs[0].token_ids == fresh_a.outputs[0].token_ids
    [again_b] = served(2, [B])
    assert again_b.num_cached_tokens == (len(B) - 1) // BLOCK * BLOCK
    assert again_b.outputs[0].token_ids == fresh_b.outputs[0].token_ids


def test_tp2_a_disk_read_that_fails_on_one_rank_only_is_a_miss(tiny_dir, tmp_path):
    """With 2 ranks each reads its own file of a block: when rank 1's file of A's third block
    is gone (rank 0's is there), that block is a miss on both, recomputed, with one rank's
    tokens; the blocks before it come back from disk.  Rank 0's read alone would have let
    rank 1 load a host slot that its read never filled."""
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    others = [[(i * p) % 40000 + 13 for i in range(150)] for p in (7727, 3571, 6007, 4409)]

    def served(tensor_parallel_size: int, folder: Path) -> LLM:
        per_token = 2 * 2 * 2 * 16 * 4 // tensor_parallel_size  # float32, per rank
        return LLM(
            tiny_dir, dtype="float32", block_size=BLOCK, max_model_len=12 * BLOCK,
            kv_cache_memory=12 * BLOCK * per_token, kv_offloading_compression="none",
            kv_offloading_size=5 * BLOCK * per_token / 2**30, kv_offloading_dir=str(folder),
            kv_offloading_dir_size=2**20, kv_offloading_store_threshold=1,
            tensor_parallel_size=tensor_parallel_size,
        )  # fmt: skip

    def tokens(llm: LLM, prompt: list[int]) -> list[int]:
        return list(llm.generate([prompt], greedy)[0].outputs[0].token_ids)

    one = served(1, tmp_path / "one")
    reference = [tokens(one, p) for p in [A, *others, A]]
    one.engine.close()
    two = served(2, tmp_path / "two")
    try:
        cm = two.engine.cache_manager
        assert tokens(two, A) == reference[0]
        keys = [b.block_hash for b in cm.pool.blocks if b.block_hash is not None]
        assert len(keys) == (len(A) + 8) // BLOCK  # A's full blocks, outputs included
        assert [tokens(two, p) for p in others] == reference[1:-1]
        assert all(key in cm.host.disk and key not in cm.host for key in keys)  # on disk only
        folder = two.engine.executor.driver_worker.runner.disk_blocks.directory
        rank1_files = [block_file(folder, key, rank=1) for key in keys]
        deadline = time.monotonic() + 30  # rank 1's writer thread, in its own process
        while not all(f.is_file() for f in rank1_files):
            assert time.monotonic() < deadline, "rank 1 never wrote its files"
            time.sleep(0.05)
        rank1_files[2].unlink()
        again = two.generate([A], greedy)[0]
        assert list(again.outputs[0].token_ids) == reference[-1]
        assert cm.host.disk.stats.num_lost_blocks == 1
        assert again.num_cached_tokens == 2 * BLOCK  # the third block and the rest recomputed
    finally:
        two.engine.close()
