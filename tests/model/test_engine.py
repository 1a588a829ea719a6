"""The engine on the embedded model: memory pressure, sizing, sampling knobs, stop strings."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.attention.kv_cache import kv_cache_bytes
from kvserve.engine.sizing import CapacityError

BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4  # K+V x layers x KV heads x head_dim x float32 = 46,080
PROMPTS = [f"Question {i}: name a colour and a number between 1 and {i + 10}." for i in range(32)]


@pytest.fixture(scope="module")
def llm():
    return LLM(kv_cache_memory=96 * 2**20, max_model_len=512, dtype="float32")


def test_sizing_gives_exact_block_counts(llm):
    sizing = llm.engine.sizing
    assert sizing.spec.bytes_per_token == BYTES_PER_TOKEN
    assert sizing.num_blocks == (96 * 2**20) // (16 * BYTES_PER_TOKEN) == 136
    assert kv_cache_bytes(llm.engine.executor.kv_caches) == 136 * 16 * BYTES_PER_TOKEN
    assert sizing.max_concurrency == 136 / 32
    assert "136 blocks x 16 tokens = 2,176 tokens" in sizing.summary()


def test_refuses_to_start_when_one_sequence_cannot_fit():
    with pytest.raises(CapacityError) as err:
        LLM(kv_cache_memory=8 * 2**20, max_model_len=8192, dtype="float32")
    msg = str(err.value)
    # 8 MiB / (16 x 46,080) = 11 blocks = 176 tokens.
    assert "cannot hold one sequence of max_model_len 8,192 tokens" in msg
    assert "largest max_model_len that fits is 176" in msg and "--max-model-len 176" in msg


def test_memory_pressure_preempts_and_outputs_equal_unpressured_runs(llm):
    """16 prompts in a cache of about 8 sequences."""
    prompts = PROMPTS[:16]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    reference = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert llm.engine.get_stats().num_preemptions == 0
    for i in (0, 11):  # and some alone
        assert llm.generate([prompts[i]], params)[0].outputs[0].token_ids == reference[i]
    prompt_len = max(len(llm.get_tokenizer().encode(p)) for p in prompts)
    blocks_per_seq = -(-(prompt_len + 24) // 16)
    tight = LLM(
        kv_cache_memory=8 * blocks_per_seq * 16 * BYTES_PER_TOKEN,  # about 8 sequences
        max_model_len=128, dtype="float32", enable_prefix_caching=False,
    )  # fmt: skip
    usage = []
    outputs = []
    engine = tight.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
        usage.append(engine.get_stats().kv_cache_usage)
        engine.cache_manager.check_invariants()
    got = {int(o.request_id): o.outputs[0].token_ids for o in outputs}
    assert [got[i] for i in range(16)] == reference
    assert engine.get_stats().num_preemptions > 0
    assert max(usage) > 0.9 and engine.cache_manager.num_free_blocks == engine.sizing.num_blocks


def test_seed_makes_sampling_reproducible(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=42, max_tokens=16)
    a = llm.generate(["Tell me a story"], params)[0].outputs[0].token_ids
    # The same seed in a different batch gives the same tokens.
    b = llm.generate(["Other prompt", "Tell me a story"], [SamplingParams(max_tokens=5), params])
    assert b[1].outputs[0].token_ids == a
    c = llm.generate(["Tell me a story"], SamplingParams(temperature=1.0, seed=43, max_tokens=16))
    assert c[0].outputs[0].token_ids != a


def test_n_samples_each_equal_a_request_with_seed_plus_index(llm):
    params = SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=12)
    out = llm.generate(["The weather today is"], params)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    for i, sample in enumerate(out.outputs):
        single = SamplingParams(temperature=0.8, seed=7 + i, max_tokens=12)
        alone = llm.generate(["The weather today is"], single)[0].outputs[0]
        assert sample.token_ids == alone.token_ids


def test_stop_strings_and_stop_tokens(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    full = llm.generate(["Count: 1, 2, 3,"], greedy)[0].outputs[0]
    assert " 6" in full.text
    stopped = llm.generate(
        ["Count: 1, 2, 3,"], SamplingParams(temperature=0.0, max_tokens=40, stop=[" 6"])
    )[0].outputs[0]
    assert stopped.text == full.text[: full.text.index(" 6")]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == " 6"
    stop_id = full.token_ids[3]
    by_token = llm.generate(
        ["Count: 1, 2, 3,"],
        SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop_id]),
    )[0].outputs[0]
    assert by_token.token_ids == full.token_ids[: full.token_ids.index(stop_id) + 1]
    assert by_token.stop_reason == stop_id


def test_max_tokens_min_tokens_and_eos(llm):
    chat = [{"role": "user", "content": "Say hello."}]
    out = llm.chat(chat, SamplingParams(temperature=0.0, max_tokens=100)).outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == 2  # <|im_end|>
    n = len(out.token_ids)
    longer = llm.chat(chat, SamplingParams(temperature=0.0, max_tokens=100, min_tokens=n + 5))
    assert len(longer.outputs[0].token_ids) >= n + 5
    assert 2 not in longer.outputs[0].token_ids[: n + 4]
    capped = llm.chat(chat, SamplingParams(temperature=0.0, max_tokens=3)).outputs[0]
    assert len(capped.token_ids) == 3 and capped.finish_reason == "length"


def test_too_long_request_is_rejected_and_engine_keeps_working(llm):
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        llm.generate(["x " * 600], SamplingParams(max_tokens=10))
    assert llm.generate(["Hi"], SamplingParams(temperature=0.0, max_tokens=2))[0].finished


def test_planner_agrees_with_the_engine_start_up_log(llm):
    from kvserve.models.loader import embedded_model_path
    from kvserve.planner import PlanInputs, make_plan
    from kvserve.planner.readers import load_model_shape

    shape = load_model_shape(str(embedded_model_path()))
    inputs = PlanInputs(
        gpu_name="host", gpu_memory=2**30, context_len=512, weight_dtype="float32",
        kv_cache_memory=96 * 2**20,
    )  # fmt: skip
    auto = next(d for d in make_plan(shape, inputs).dtypes if d.kv_cache_dtype == "auto")
    sizing = llm.engine.sizing
    assert auto.num_blocks == sizing.num_blocks
    assert auto.max_concurrency == sizing.max_concurrency
    assert f"{auto.num_blocks:,} blocks" in sizing.summary()
    assert f"max concurrency at 512 tokens: {auto.max_concurrency:.1f}x" in sizing.summary()
