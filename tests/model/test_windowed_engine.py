"""Sliding-window and hybrid models through the whole engine, KV cache groups included
(kv/groups.py): transformers' greedy tokens from every backend that serves them, with chunked
prefill, preemption, and prefix hits on a shared prefix longer than the window."""

from __future__ import annotations

import pytest
from windowed_models import NEW_TOKENS, PROMPT, WINDOW

from kvserve import LLM, SamplingParams
from kvserve.kv.groups import NULL_BLOCK

NUM_BLOCKS = 100
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def make_llm(directory, **kwargs) -> LLM:
    options = dict(kv_cache_memory=8 * 2**20, max_model_len=512, dtype="float32")
    return LLM(str(directory), **{**options, **kwargs})


@pytest.mark.parametrize("backend", ["cpu-paged", "flex"])
@pytest.mark.parametrize("arch", ["gemma3", "mistral", "qwen3"])
def test_every_backend_gives_transformers_tokens_in_chunks(tiny, reference, arch, backend):
    """A 200-token prompt in 48-token chunks (chunks after cached context, past the window),
    then 64 decodes: each group's tables, the window's freed blocks and the backend's window
    together give transformers' tokens."""
    directory, _ = tiny(arch)
    llm = make_llm(directory, attention_backend=backend, max_num_batched_tokens=48)
    groups = llm.engine.sizing.spec.groups
    assert len(groups) == {"gemma3": 6, "mistral": 1, "qwen3": 2}[arch]
    assert all(g.window == WINDOW for g in groups[1:])
    assert llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids == reference(arch)
    llm.engine.cache_manager.check_invariants()
    assert llm.engine.cache_manager.num_free_blocks == llm.engine.sizing.num_blocks


def test_window_blocks_are_freed_while_decoding(tiny):
    """Mid-decode, a window group holds only the blocks of its window; a full group all."""
    directory, _ = tiny("gemma3")
    llm = make_llm(directory)
    engine = llm.engine
    engine.add_request("r", PROMPT, SamplingParams(temperature=0.0, max_tokens=32))
    for _ in range(20):
        engine.step()
    cm = engine.cache_manager
    full, windows = cm.block_table("r"), cm.group_block_tables("r")
    assert len(windows) == 5 and NULL_BLOCK not in full
    for table in windows:
        held = [b for b in table if b != NULL_BLOCK]
        assert len(held) <= -(-(WINDOW - 1) // 16) + 1 < len(full)
    while engine.has_unfinished_requests():
        engine.step()


def test_preempted_hybrid_requests_recompute_to_the_same_tokens(tiny, reference):
    """100 blocks of one layer each: a 264-token sequence ends with 37 (17 full, 4 in each
    window group), so six at once, admitted in 64-token chunks, outgrow the cache and the
    scheduler preempts; every output is still transformers'."""
    directory, _ = tiny("gemma3")
    block_bytes = 16 * 2 * 2 * 32 * 4  # tokens x K/V x KV heads x head_dim x float32
    llm = make_llm(directory, kv_cache_memory=NUM_BLOCKS * block_bytes, max_model_len=264,
                   max_num_batched_tokens=64,
                   enable_prefix_caching=False)  # fmt: skip
    outputs = llm.generate([PROMPT] * 6, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == [reference("gemma3")] * 6


def test_shared_prefix_hits_for_every_request_after_the_first(tiny):
    """W3's shape on a Gemma-3-shaped model: 8 prompts sharing 4 windows of prefix, sent at
    once: every request after the first finds cached tokens (computed in the same step or
    before), and the outputs equal those with prefix caching off."""
    directory, _ = tiny("gemma3")
    prefix = PROMPT[: 4 * WINDOW]
    prompts = [prefix + [100 + 37 * i + j for j in range(16)] for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    cached = make_llm(directory).generate(prompts, params)
    assert all(o.num_cached_tokens > 0 for o in cached[1:])
    assert cached[0].num_cached_tokens == 0
    uncached = make_llm(directory, enable_prefix_caching=False).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in cached] == [o.outputs[0].token_ids for o in uncached]
    again = make_llm(directory).generate(prompts[:1] * 2, params)  # a later, sequential hit
    assert again[1].num_cached_tokens >= 4 * WINDOW - 16


def test_start_up_log_gives_the_planners_bytes_per_sequence(tiny, caplog):
    """A Gemma-3-shaped model at --max-model-len 8192: the log's bytes per sequence are
    `kvserve plan`'s for the same config.json, and 3x the sequences fit that would with every
    layer full."""
    from kvserve.planner.layers import kv_layout
    from kvserve.planner.readers import read_hf_config

    directory, _ = tiny("gemma3")
    with caplog.at_level("INFO", logger="kvserve"):
        llm = make_llm(directory, max_model_len=8192, allow_long_max_model_len=True)
    sizing = llm.engine.sizing
    planned = kv_layout(read_hf_config(directory / "config.json"), "auto", 16)
    planned_bytes = planned.block_bytes_per_sequence(8192)
    assert f"{planned_bytes:,} bytes per sequence of 8,192 tokens" in caplog.text
    assert "KV cache group 1: sliding window 48, layers 0" in caplog.text
    all_full = sizing.num_blocks / (6 * 512)
    assert sizing.max_concurrency >= 3 * all_full


def test_prefix_store_keeps_every_groups_blocks_across_a_restart(tiny, tmp_path):
    """--prefix-cache-dir on a hybrid model: each group's blocks are written (one group's
    slots per stored block) and loaded back, so the restarted engine finds the whole prompt
    but its last partial block, and decodes the same tokens."""
    directory, _ = tiny("gemma3")
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    first = make_llm(directory, prefix_cache_dir=str(tmp_path))
    fresh = first.generate([PROMPT], params)[0]
    first.engine.close()  # writes the store
    restarted = make_llm(directory, prefix_cache_dir=str(tmp_path))
    again = restarted.generate([PROMPT], params)[0]
    assert again.num_cached_tokens == (len(PROMPT) - 1) // 16 * 16
    assert again.outputs[0].token_ids == fresh.outputs[0].token_ids
    restarted.engine.close()
