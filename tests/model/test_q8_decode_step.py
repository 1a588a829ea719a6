"""A float32 model's decode steps over 8-bit weights in one C call (models/q8_decode_step.py,
native/csrc/layer/decode_step_q8.c) against the per-layer path it stands in for: the same
greedy tokens and logprobs to float32 rounding, over float32 and 8-bit caches, with and
without a QKV bias; steps it does not take (prefills, more rows than the 8-bit kernel takes)
keep the per-layer path; the engine takes it at start-up unless eager, and drops it where it
fails its warm-up."""

from __future__ import annotations

import pytest
import torch
from helpers import count_step_rows

from kvserve import LLM, SamplingParams
from kvserve.models.q8_decode_step import Q8DecodeStep
from kvserve.native import ops

pytestmark = pytest.mark.skipif(not ops.available(), reason="no native library here")
PROMPTS = [[(i * 7919 + j) % 500 + 7 for i in range(9 + 13 * j)] for j in range(3)]


def _engine(
    directory, kv_cache_dtype: str = "auto", enforce_eager: bool = True, weights: str = "int8"
) -> LLM:
    """int8 (or int4) weights over a float32 model.  No prefix caching: a second run must
    compute what the first did, not read its K/V back."""
    return LLM(str(directory), dtype="float32", weight_dtype=weights, kv_cache_memory=8 * 2**20,
               max_model_len=256, enforce_eager=enforce_eager, enable_prefix_caching=False,
               kv_cache_dtype=kv_cache_dtype, kv_cache_dtype_check="off")  # fmt: skip


def _model(llm: LLM):
    return llm.engine.executor.driver_worker.model


def _greedy(llm: LLM, prompts=PROMPTS, max_tokens: int = 12):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    outputs = llm.generate(prompts, params)
    tokens = [o.outputs[0].token_ids for o in outputs]
    logprobs = [[step.logprob for step in o.outputs[0].logprobs]
                for o in outputs]  # fmt: skip
    return tokens, logprobs


@pytest.mark.parametrize(
    ("arch", "kv_cache_dtype", "weights"),
    [
        ("llama3", "auto", "int8"), ("llama3", "int8", "int8"), ("llama3", "fp8_e4m3", "int8"),
        ("qwen2", "auto", "int8"), ("llama3", "auto", "int4"), ("qwen2", "int8", "int4"),
    ],
)  # fmt: skip
def test_one_call_decode_steps_give_the_per_layer_tokens(
    tiny_model_dir, monkeypatch, arch, kv_cache_dtype, weights
):
    """Three prompts' decode steps in one call each: the per-layer path's greedy tokens, and
    its logprobs to float32 rounding; the prefill step keeps the per-layer path.  Over an
    8-bit cache the step quantizes the new rows with the per-layer path's store; over 4-bit
    weights both paths take linear_q4.c for these few rows."""
    llm = _engine(tiny_model_dir(arch)[0], kv_cache_dtype, weights=weights)
    model = _model(llm)
    want_tokens, want_logprobs = _greedy(llm)
    assert model.use_q8_decode_step()
    steps = count_step_rows(monkeypatch, Q8DecodeStep)
    tokens, logprobs = _greedy(llm)
    assert steps == [3] * 11  # the 11 decode steps, not the prefill step
    assert tokens == want_tokens
    for got, want in zip(logprobs, want_logprobs, strict=True):
        assert got == pytest.approx(want, abs=1e-4)


def test_steps_of_more_rows_than_the_kernel_takes_keep_the_per_layer_path(
    tiny_model_dir, monkeypatch
):
    """Ten sequences decode together per layer (the 8-bit kernel takes up to 8 rows; torch's
    product serves more), and in one call once fewer remain, with the per-layer tokens."""
    llm = _engine(tiny_model_dir("llama3")[0])
    prompts = [[(i * 31 + j) % 500 + 7 for i in range(5 + j)] for j in range(10)]
    want, _ = _greedy(llm, prompts, max_tokens=4)
    assert _model(llm).use_q8_decode_step()
    steps = count_step_rows(monkeypatch, Q8DecodeStep)
    assert _greedy(llm, prompts, max_tokens=4)[0] == want
    assert steps == []
    assert _greedy(llm, prompts[:8], max_tokens=4)[0] == want[:8]
    assert steps == [8] * 3


def test_the_engine_takes_the_step_unless_eager_and_drops_one_that_fails(
    tiny_model_dir, monkeypatch, caplog
):
    """At start-up (not eager) an int8 float32 model takes the one-call step; --enforce-eager
    keeps the per-layer path, and float weights have nothing for it to read.  A step that
    fails its warm-up is dropped with a warning, and the engine serves the per-layer tokens."""
    from kvserve.models import llama

    directory = tiny_model_dir("llama3")[0]
    monkeypatch.setattr(llama.LlamaForCausalLM, "compile", lambda self: None)  # no compiler
    eager = _engine(directory)
    assert _model(eager).q8_step is None
    want, _ = _greedy(eager)
    assert _model(_engine(directory, enforce_eager=False)).q8_step is not None
    float_weights = LLM(str(directory), dtype="float32", weight_dtype="float",
                        kv_cache_memory=8 * 2**20, max_model_len=256,
                        enforce_eager=False)  # fmt: skip
    assert _model(float_weights).q8_step is None

    def broken(*args):
        raise RuntimeError("declined")

    monkeypatch.setattr(Q8DecodeStep, "run_step", broken)
    llm = _engine(directory, enforce_eager=False)
    assert _model(llm).q8_step is None
    assert "the 8-bit decode step failed" in caplog.text
    assert _greedy(llm)[0] == want


def test_the_step_refuses_a_shared_prefix_plan_and_other_layers(tiny_model_dir, monkeypatch):
    """A plan with a prefix attended apart is not the step's (the float32 backend never makes
    one: it needs the bf16 prefix kernel); windowed or bfloat16 layers get no step."""
    from dataclasses import replace

    from kvserve.attention.base import DecodeStepPlan

    model = _model(_engine(tiny_model_dir("llama3")[0]))
    step = Q8DecodeStep.build(model.layers)
    assert step is not None and step.max_rows == 8
    one = torch.zeros(1, dtype=torch.int64)
    plan = DecodeStepPlan(kv_caches=(), tables=one.view(1, 1), seq_lens=one + 1, slots=one,
                          block_size=16, prefix_blocks=1)  # fmt: skip
    with pytest.raises(ValueError, match="without a prefix"):
        step.run_step(model.layers, None, None, None, plan)
    assert not model._q8_step_serves(replace(plan, prefix_blocks=0), 9)  # over 8 rows
    monkeypatch.setattr(model.layers[1], "sliding_window", 16)
    assert Q8DecodeStep.build(model.layers) is None
    bf16 = LLM(str(tiny_model_dir("llama3")[0]), dtype="bfloat16", weight_dtype="int8",
               kv_cache_memory=8 * 2**20, max_model_len=256, enforce_eager=True)  # fmt: skip
    assert Q8DecodeStep.build(_model(bf16).layers) is None


def test_float32_plans_leave_a_prefix_attended_apart_to_the_layers(tiny_model_dir):
    """plan_decode_step plans a float32 decode-only step (the float32 cache's own queries)
    except where a prefix shared by enough decodes is attended apart: its kernel reads bf16
    rows, so the layers call `forward` for such a step."""
    from kvserve.attention.base import AttentionMetadata

    engine = _engine(tiny_model_dir("llama3")[0]).engine
    caches, backend = engine.executor.kv_caches, engine.executor.driver_worker.backend
    tables = torch.arange(40, dtype=torch.int32).view(4, 10)

    def plan(count: int, shared_blocks: int):
        metadata = AttentionMetadata(
            slot_mapping=torch.arange(count) + 200, num_decode_tokens=count,
            decode_block_tables=tables[:count], decode_seq_lens=torch.full((count,), 150),
            prefills=(), shared_prefix_blocks=shared_blocks,
        )  # fmt: skip
        return backend.plan_decode_step(caches, metadata, torch.float32, 4)

    assert caches[0].key.dtype == torch.float32
    whole = plan(3, 8)  # 3 sequences: the prefix is not attended apart
    assert whole.prefix_blocks == 0 and whole.seq_lens.tolist() == [150] * 3
    assert plan(4, 8) is None  # 128 tokens shared by 4: attended apart, in bf16
