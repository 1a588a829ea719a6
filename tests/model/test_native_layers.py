"""The layers' native path (models/native_layers.py, native/csrc/layer/decode_layer.c) against
the compiled layers it stands in for: the same values bit for bit, layer by layer and through
the engine.  Where it serves a model, the engine runs every step there and compiles nothing.

The tiny models here have head_dim 32 (the C code takes head_dims and hidden sizes that are
multiples of 32: the conftest models' head_dim of 16 is not served), llama without and qwen2
with QKV bias.  The path needs bfloat16 packing and an AMX build of the kernels: elsewhere
these tests are skipped and the engine keeps the compiled layers (test_eager_engines_and_
unservable_shapes_have_no_native_path).
"""

from __future__ import annotations

import pytest
import torch
from helpers import count_step_rows

from kvserve import LLM, SamplingParams
from kvserve.models.llama import compiled_kernels
from kvserve.models.native_layers import NativeLayers, native_kernels
from kvserve.models.packed_linear import KERNEL_ALL_ROWS, can_pack

pytestmark = pytest.mark.skipif(
    not can_pack(torch.device("cpu"), torch.bfloat16) or native_kernels() is None,
    reason="no bfloat16 packing or no AMX build of the kernels on this CPU",
)
PROMPTS = [[(i * 7919 + j) % 40000 + 7 for i in range(20 + 13 * j)] for j in range(3)]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, embedded_tokenizer):
    """arch -> a tiny random bf16-servable model directory (head_dim 32, sharp weights)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    shape = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                 vocab_size=49152, rms_norm_eps=1e-5, initializer_range=0.1)  # fmt: skip
    made = {}
    for arch, config in (("llama", LlamaConfig(**shape, tie_word_embeddings=False)),
                         ("qwen2", Qwen2Config(**shape, tie_word_embeddings=True))):  # fmt: skip
        torch.manual_seed(1234)
        model = AutoModelForCausalLM.from_config(config).float().eval()
        directory = tmp_path_factory.mktemp(f"native-{arch}")
        model.save_pretrained(directory)
        embedded_tokenizer.save_pretrained(directory)
        made[arch] = str(directory)
    return made


def _served_engine(directory: str, kv_cache_dtype: str = "auto") -> LLM:
    """An engine as `kvserve serve` starts it (not eager: the native path, or else the
    compiled layers).  No prefix caching: a second run must compute what the first did, not
    read its K/V back."""
    return LLM(directory, dtype="bfloat16", kv_cache_memory=4 * 2**20, max_model_len=256,
               enforce_eager=False, enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype,
               kv_cache_dtype_check="off")  # fmt: skip


def _layer_inputs(model, rows: int, real: int, seed: int):
    """hidden [rows, H], cos/sin [rows, 1, D/2] and an attention output of `real` rows."""
    generator = torch.Generator().manual_seed(seed)
    config = model.config
    hidden = torch.randn(rows, config.hidden_size, generator=generator).to(torch.bfloat16)
    freqs = (torch.arange(rows).float() * 3)[:, None] * model.inv_freq[None, :]
    cos, sin = (f.to(torch.bfloat16)[:, None, :] for f in (freqs.cos(), freqs.sin()))
    attn = torch.randn(real, config.num_heads, config.head_dim, generator=generator)
    return hidden, cos, sin, attn.to(torch.bfloat16)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_native_layers_equal_the_compiled_layers_bit_for_bit(model_dirs, arch):
    """pre_attention, between_attentions and post_attention, for steps of 1 token (16 rows
    after padding), 37 tokens (48 rows), 128 tokens and a prefill's 520 tokens (528 rows:
    the projections' kernel takes them in chunks of 256): every output equal to the compiled
    layers' in the rows the step uses."""
    model = _served_engine(model_dirs[arch]).engine.executor.driver_worker.model
    native, compiled = model.native_layers, compiled_kernels()
    assert native is not None
    assert all(layer.qkv_proj.kernel_rows == KERNEL_ALL_ROWS for layer in model.layers)
    assert (model.layers[0].qkv_proj.bias is not None) == (arch == "qwen2")
    first, second, last = model.layers[0], model.layers[1], model.layers[-1]

    def outputs(kernels, hidden, cos, sin, attn) -> list[tuple[torch.Tensor, ...]]:
        return [
            kernels.pre_attention(first, hidden.clone(), cos, sin),
            kernels.between_attentions(first, second, hidden.clone(), attn, cos, sin),
            (kernels.post_attention(last, hidden.clone(), attn),),
        ]

    with torch.inference_mode():
        for seed, (rows, real) in enumerate([(16, 1), (48, 37), (128, 128), (528, 520)]):
            inputs = _layer_inputs(model, rows, real, seed)
            for want, got in zip(outputs(compiled, *inputs), outputs(native, *inputs),
                                 strict=True):  # fmt: skip
                assert len(want) == len(got)
                for w, g in zip(want, got, strict=True):
                    assert g.shape == w.shape and g.dtype == w.dtype
                    assert torch.equal(g[:real], w[:real])


def test_the_engine_runs_every_step_natively_with_the_compiled_tokens(model_dirs, monkeypatch):
    """Greedy tokens and logprobs of the engine, which runs every step natively (a prefill step
    of 339 tokens, past the projections' 256-row chunks, too), equal those of the compiled
    layers alone; its decode steps did go through the native path."""
    llm = _served_engine(model_dirs["llama"])
    model = llm.engine.executor.driver_worker.model
    calls = []
    original = NativeLayers.between_attentions

    def counted(self, *args):
        calls.append(args[2].shape[0])
        return original(self, *args)

    monkeypatch.setattr(NativeLayers, "between_attentions", counted)
    prompts = [*PROMPTS, [(i * 131) % 40000 + 7 for i in range(240)]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)

    def run() -> list[tuple[list[int], list[float]]]:
        outputs = llm.generate(prompts, params)
        return [(o.outputs[0].token_ids, [e.logprob for e in o.outputs[0].logprobs])
                for o in outputs]  # fmt: skip

    whole_steps = count_step_rows(monkeypatch, NativeLayers)
    native = run()
    assert set(calls) == {384}  # the 4 prompts (339 tokens on 384 rows) in one step
    assert whole_steps == [16] * 11  # then the decodes, all layers in one call each
    calls.clear()
    whole_steps.clear()
    model.native_layers, kept = None, model.native_layers
    model.kernels = compiled_kernels()
    assert run() == native
    assert not calls and not whole_steps
    model.native_layers = kept


def _greedy_run(llm: LLM) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    return [(o.outputs[0].token_ids, [e.logprob for e in o.outputs[0].logprobs])
            for o in llm.generate(PROMPTS, params)]  # fmt: skip


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8_e4m3", "fp8_e5m2"])
def test_decode_steps_in_one_call_give_the_per_layer_tokens(
    model_dirs, monkeypatch, kv_cache_dtype
):
    """A decode-only step runs every layer, attention included, in one C call (run_step),
    with the per-layer native calls' greedy tokens and logprobs bit for bit; the step with
    the prefills keeps the per-layer calls.  Over a bf16 cache the decode kernel stores the
    new rows; over an 8-bit one the one-call step quantizes them with the per-layer path's
    store (the same codes and scales) before each layer's attention."""
    llm = _served_engine(model_dirs["llama"], kv_cache_dtype)
    native = llm.engine.executor.driver_worker.model.native_layers
    assert native.runs_whole_steps
    whole_steps = count_step_rows(monkeypatch, NativeLayers)
    whole = _greedy_run(llm)
    assert whole_steps == [16] * 11  # the 3 prompts' 11 decode steps, not their prefill step
    whole_steps.clear()
    monkeypatch.setattr(native, "runs_whole_steps", False)
    assert _greedy_run(llm) == whole
    assert not whole_steps


def test_one_call_steps_leave_prefills_and_8_bit_shared_prefixes_to_the_layers(model_dirs):
    """plan_decode_step declines what `forward` attends otherwise (prefills, queries of another
    dtype than the cache's, an 8-bit cache's prefix shared by enough decodes), and plans a
    prefix shared by enough decodes to be attended once (128 tokens, 4 sequences) as `forward`
    splits it: the first sequence's prefix blocks, each sequence's length past the prefix,
    buffers for the prefix's outputs and log-sum-exps.  An 8-bit cache's plan carries its
    scales."""
    import dataclasses

    from kvserve.attention.base import AttentionMetadata

    llm = _served_engine(model_dirs["llama"])
    engine = llm.engine
    caches, dtype, heads = engine.executor.kv_caches, torch.bfloat16, 4
    tables = torch.arange(40, dtype=torch.int32).view(4, 10)

    def decodes(count: int, shared_blocks: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=torch.arange(count) + 200, num_decode_tokens=count,
            decode_block_tables=tables[:count], decode_seq_lens=torch.full((count,), 150),
            prefills=(), shared_prefix_blocks=shared_blocks,
        )  # fmt: skip

    def plan(metadata, kv_caches=caches, model_dtype=dtype):
        backend = engine.executor.driver_worker.backend
        return backend.plan_decode_step(kv_caches, metadata, model_dtype, heads)

    whole = plan(decodes(4, 7))  # 112 shared tokens: not attended apart
    assert whole.tables.dtype == torch.int64 and whole.block_size == 16
    assert whole.kv_caches == tuple(caches) and whole.kv_caches[0].key_scale is None  # bf16
    assert whole.prefix_blocks == 0 and whole.prior_out is None
    assert whole.seq_lens.tolist() == [150] * 4
    assert plan(decodes(3, 8)).prefix_blocks == 0  # 3 sequences: not attended apart
    split = plan(decodes(4, 8))
    assert split.prefix_blocks == 8 and split.prefix_table.tolist() == list(range(8))
    assert split.seq_lens.tolist() == [150 - 128] * 4
    assert split.prior_out.shape == (4, heads, 32) and split.prior_lse.shape == (4, heads)
    assert plan(decodes(3, 8), model_dtype=torch.float32) is None  # queries unlike the cache
    assert plan(dataclasses.replace(decodes(1, 0), prefills=("a prefill",))) is None
    int8 = LLM(model_dirs["llama"], dtype="bfloat16", kv_cache_memory=4 * 2**20,
               max_model_len=256, enforce_eager=False, enable_prefix_caching=False,
               kv_cache_dtype="int8", kv_cache_dtype_check="off").engine.executor  # fmt: skip
    quantized = plan(decodes(2, 0), kv_caches=int8.kv_caches)
    assert quantized.kv_caches == tuple(int8.kv_caches)
    assert quantized.kv_caches[0].key_scale is not None  # int8: scaled
    assert plan(decodes(4, 7), kv_caches=int8.kv_caches).prefix_blocks == 0
    assert plan(decodes(4, 8), kv_caches=int8.kv_caches) is None  # forward gathers the prefix


def test_decode_steps_after_a_shared_prefix_in_one_call_give_the_per_layer_tokens(model_dirs):
    """Six requests after one 160-token prefix: their decode steps attend the prefix once for
    all (`forward`'s split) inside the one-call step, with the per-layer path's greedy tokens
    and logprobs bit for bit (each run on an engine of its own: a second run on one engine
    would read its prompts from the prefix cache)."""
    prefix = [(i * 7919) % 40000 + 7 for i in range(160)]
    prompts = [prefix + [(i * 31 + j) % 40000 + 7 for i in range(5 + j)] for j in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=0)

    def run(whole_steps: bool) -> tuple[list, list[int]]:
        llm = LLM(model_dirs["llama"], dtype="bfloat16", kv_cache_memory=4 * 2**20,
                  max_model_len=256, enforce_eager=False)  # fmt: skip
        native = llm.engine.executor.driver_worker.model.native_layers
        native.runs_whole_steps = whole_steps
        prefixes = []
        original = native.run_step

        def counted(layers, hidden, cos, sin, num_tokens, plan):
            prefixes.append(plan.prefix_blocks)
            return original(layers, hidden, cos, sin, num_tokens, plan)

        native.run_step = counted
        outputs = llm.generate(prompts, params)
        tokens = [(o.outputs[0].token_ids, [e.logprob for e in o.outputs[0].logprobs])
                  for o in outputs]  # fmt: skip
        return tokens, prefixes

    whole, prefixes = run(True)
    assert prefixes == [10] * 9  # the 9 decode steps, each after the 10 shared blocks
    per_layer, none = run(False)
    assert per_layer == whole and none == []


def test_start_up_compiles_nothing_where_the_native_path_serves(model_dirs, monkeypatch):
    """The native path is warmed up on the small steps (1, 16, 17 tokens) and serves every
    step from then on: the layers are not compiled, and no step compiles a graph."""
    from torch._dynamo.utils import counters

    from kvserve.models import llama
    from kvserve.runner.model_runner import ModelRunner

    warm_ups = []
    original = ModelRunner.warm_up

    def recorded(self, *token_counts):
        warm_ups.append((*token_counts, self.model.native_layers is not None))
        return original(self, *token_counts)

    monkeypatch.setattr(ModelRunner, "warm_up", recorded)
    graphs = counters["stats"]["unique_graphs"]
    llm = _served_engine(model_dirs["llama"])
    assert warm_ups == [(True,)]
    assert llm.engine.executor.driver_worker.model.kernels is llama.EAGER
    prompts = [[(i * 7919 + j) % 40000 + 7 for i in range(length)] for j, length in
               enumerate((150, 144, 200))]  # fmt: skip
    for prompt in prompts:
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert counters["stats"]["unique_graphs"] == graphs


def test_a_failing_native_path_leaves_the_compiled_layers(model_dirs, monkeypatch):
    """Where the native path fails at the warm-up, the engine compiles the layers, whose
    tokens are the native path's."""
    from kvserve.models import llama

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    native = _served_engine(model_dirs["llama"])
    want = [o.outputs[0].token_ids for o in native.generate(PROMPTS, params)]

    def broken(*args):
        raise RuntimeError("no AMX after all")

    monkeypatch.setattr(NativeLayers, "pre_attention", broken)
    llm = _served_engine(model_dirs["llama"])
    assert llm.engine.executor.driver_worker.model.native_layers is None
    assert llm.engine.executor.driver_worker.model.kernels is not llama.EAGER  # compiled
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == want


def test_a_failing_compiler_leaves_eager_layers(model_dirs, monkeypatch):
    """Without the native path, where torch.compile fails at the warm-up, the engine runs
    the eager layers for every step, with the eager engine's tokens."""
    from kvserve.models import llama

    def broken(*args):
        raise RuntimeError("no C++ compiler")

    def compile_broken(model):
        model.kernels = llama.LayerKernels(broken, broken, broken)

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    eager = LLM(model_dirs["llama"], dtype="bfloat16", kv_cache_memory=4 * 2**20,
                max_model_len=256, enforce_eager=True)  # fmt: skip
    want = [o.outputs[0].token_ids for o in eager.generate(PROMPTS, params)]
    monkeypatch.setattr(llama.LlamaForCausalLM, "compile", compile_broken)
    monkeypatch.setattr(NativeLayers, "build", classmethod(lambda cls, layers: None))
    llm = _served_engine(model_dirs["llama"])
    assert llm.engine.executor.driver_worker.model.kernels is llama.EAGER
    assert llm.engine.executor.driver_worker.model.native_layers is None
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == want


def test_eager_engines_and_unservable_shapes_have_no_native_path(model_dirs, tiny_model_dir):
    """--enforce-eager keeps the reference layers; a head_dim of 16 is not served."""
    eager = LLM(model_dirs["llama"], dtype="bfloat16", kv_cache_memory=4 * 2**20,
                max_model_len=256, enforce_eager=True)  # fmt: skip
    assert eager.engine.executor.driver_worker.model.native_layers is None
    narrow = LLM(str(tiny_model_dir("llama3")[0]), dtype="bfloat16", kv_cache_memory=4 * 2**20,
                 max_model_len=256)  # fmt: skip
    assert NativeLayers.build(narrow.engine.executor.driver_worker.model.layers) is None


def test_a_running_profiler_keeps_the_per_layer_calls(model_dirs, monkeypatch):
    """Under torch.profiler the decode steps take the per-layer calls, each a range of its
    own, so that benchmarks/profile_offline.py tells attention from the layers."""
    from torch.profiler import ProfilerActivity, profile

    llm = _served_engine(model_dirs["llama"])
    whole_steps = count_step_rows(monkeypatch, NativeLayers)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate(PROMPTS[:1], params)
    counts = {event.key: event.count for event in prof.key_averages()}
    assert not whole_steps
    assert counts["kvserve::attention"] == 4 * 3  # 4 steps x 3 layers
    llm.generate(PROMPTS[:1], params)
    assert whole_steps == [16] * 3  # without the profiler: the 3 decode steps in one call
