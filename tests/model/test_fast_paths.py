"""Every fast path against the reference path it replaces:

* oneDNN-prepacked linear layers (bfloat16 on a CPU) give the values of F.linear;
* torch.compile'd layers (the engine's default; the rest of the suite runs eagerly through
  KVSERVE_ENFORCE_EAGER=1 to save compile time) give the eager logits: within 1e-5 in float32
  and the same greedy tokens; within bfloat16 rounding in bfloat16;
* the sampler's faster argmax picks the first maximum, as torch.argmax does.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve import LLM, SamplingParams
from kvserve.models.packed_linear import (
    KERNEL_ALL_ROWS,
    PackedLinear,
    can_pack,
    logits_kernel_max_rows,
)
from kvserve.runner.sampling import _argmax

PROMPTS = [[(i * 7919 + j) % 40000 + 7 for i in range(20 + 13 * j)] for j in range(3)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_dir):
    return str(tiny_model_dir("llama3")[0])


NO_BF16_PACKING = "oneDNN cannot pack bf16 on this CPU"


@pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.bfloat16), reason=NO_BF16_PACKING)
@pytest.mark.parametrize("shape", [(1, 64), (7, 64), (3, 5, 64)])
def test_packed_linear_equals_f_linear(shape):
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 64, dtype=torch.bfloat16), torch.randn(96, dtype=torch.bfloat16)
    x = torch.randn(*shape, dtype=torch.bfloat16)
    for b in (None, bias):
        got = PackedLinear(weight, b)(x)
        want = F.linear(x, weight, b)
        assert got.shape == want.shape
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=1e-2)


def _logprobs_and_tokens(llm: LLM) -> tuple[list[list[int]], list[list[float]]]:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    outputs = llm.generate(PROMPTS, params)
    tokens = [o.outputs[0].token_ids for o in outputs]
    logprobs = [[e.logprob for e in o.outputs[0].logprobs] for o in outputs]
    return tokens, logprobs


@pytest.mark.parametrize(("dtype", "tolerance"), [("float32", 1e-4), ("bfloat16", 0.15)])
def test_compiled_layers_match_eager(tiny_dir, dtype, tolerance):
    def make(eager: bool) -> LLM:
        return LLM(tiny_dir, dtype=dtype, kv_cache_memory=4 * 2**20, max_model_len=256,
                   enforce_eager=eager)  # fmt: skip

    eager, compiled = make(True), make(False)
    compiled_model = compiled.engine.executor.driver_worker.model  # really compiled:
    assert compiled_model.kernels is not eager.engine.executor.driver_worker.model.kernels
    eager_tokens, eager_lp = _logprobs_and_tokens(eager)
    compiled_tokens, compiled_lp = _logprobs_and_tokens(compiled)
    if dtype == "float32":
        assert compiled_tokens == eager_tokens
    for a_tokens, b_tokens, a, b in zip(eager_tokens, compiled_tokens, eager_lp, compiled_lp,
                                        strict=True):  # fmt: skip
        pairs = enumerate(zip(a_tokens, b_tokens, strict=True))
        same = next((i for i, (x, y) in pairs if x != y), len(a))
        assert same > 0  # the first token always agrees (bf16 near-ties may differ later)
        assert max(abs(x - y) for x, y in zip(a[:same], b[:same], strict=True)) < tolerance


def test_argmax_is_the_first_maximum():
    x = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -2.0, -0.5, -0.5]])
    assert _argmax(x).tolist() == x.argmax(dim=-1).tolist() == [1, 0, 2]
    wide = torch.randn(64, 49152)
    assert torch.equal(_argmax(wide), wide.argmax(dim=-1))


def test_packed_rows_are_bucketed_and_the_padding_never_shows():
    from kvserve.models.packed_linear import padded_rows

    assert [padded_rows(n) for n in (1, 16, 17, 256, 257, 2048, 2049)] == [
        16, 16, 32, 256, 320, 2048, 2304]  # fmt: skip
    if not can_pack(torch.device("cpu"), torch.bfloat16):
        pytest.skip(NO_BF16_PACKING)
    weight = torch.randn(40, 64, dtype=torch.bfloat16)
    layer = PackedLinear(weight, None)
    for rows in (1, 5, 17, 300):
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        got = layer(x)
        assert got.shape == (rows, 40)
        torch.testing.assert_close(got.float(), F.linear(x, weight).float(), atol=2e-2, rtol=1e-2)


def test_compile_warm_up_never_touches_blocks_loaded_from_the_store(tiny_dir, tmp_path):
    """The warm-up pass writes dummy K/V into the first blocks; the prefix cache store is
    loaded after it, so a restarted, compiled engine serves its cold blocks intact: the same
    greedy tokens as computing the prompt afresh."""
    prompt = [(i * 7919) % 40000 + 7 for i in range(70)]  # 4 full blocks + 6 tokens

    def make() -> LLM:
        return LLM(tiny_dir, dtype="float32", kv_cache_memory=4 * 2**20, max_model_len=256,
                   enforce_eager=False, prefix_cache_dir=str(tmp_path))  # fmt: skip

    first = make()
    fresh = first.generate([prompt], GREEDY)[0]
    assert fresh.num_cached_tokens == 0
    first.engine.close()  # writes the store
    restarted = make()
    again = restarted.generate([prompt], GREEDY)[0]
    assert again.num_cached_tokens == 64  # loaded from disk, after the warm-up
    assert again.outputs[0].token_ids == fresh.outputs[0].token_ids


@pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.bfloat16), reason=NO_BF16_PACKING)
def test_rows_padded_once_per_step_give_the_same_logprobs(tiny_dir):
    """A packed model runs its layers on the bucketed row count (LlamaForCausalLM._padded)
    instead of padding each projection's input: the same oneDNN shapes, so the very same
    values, for steps of 3 prompts (20 + 33 + 46 = 99 rows -> 112) and of 3 decodes.  No
    prefix caching: the second run must compute what the first did, not read it back."""
    llm = LLM(tiny_dir, dtype="bfloat16", kv_cache_memory=4 * 2**20, max_model_len=256,
              enforce_eager=True, enable_prefix_caching=False)  # fmt: skip
    model = llm.engine.executor.driver_worker.model
    assert model.pads_rows
    padded = _logprobs_and_tokens(llm)
    model.pads_rows = False
    assert _logprobs_and_tokens(llm) == padded


@pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.bfloat16), reason=NO_BF16_PACKING)
def test_the_lm_head_takes_the_kernel_up_to_its_row_limit(tiny_dir):
    """The AMX kernel computes the layers' projections faster than oneDNN at every row count,
    but not the LM head past 32 rows: a 64-row decode's logits are oneDNN's.  The vdpbf16ps
    kernel (no AMX) takes the head at every row count: its 64-row logits are within bf16
    rounding of oneDNN's."""
    llm = LLM(tiny_dir, dtype="bfloat16", kv_cache_memory=4 * 2**20, max_model_len=256,
              enforce_eager=True)  # fmt: skip
    model = llm.engine.executor.driver_worker.model
    head, limit = model.logits_head, logits_kernel_max_rows()
    assert 0 <= head.kernel_rows <= limit
    assert all(layer.qkv_proj.kernel_rows in (0, KERNEL_ALL_ROWS) for layer in model.layers)
    x = torch.randn(64, head.in_features).to(torch.bfloat16)
    want = torch.ops.mkldnn._linear_pointwise(x, head.packed_weight, None, "none", [], "")
    if head.kernel_rows < 64:
        assert torch.equal(head(x), want)
    else:
        torch.testing.assert_close(head(x).float(), want.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.bfloat16), reason=NO_BF16_PACKING)
def test_every_row_count_through_the_linear_kernel_gives_onednn_values():
    """At every row count, a bf16 PackedLinear runs the library's projection kernel over
    oneDNN's packed weight (csrc/linear/linear_amx.c on AMX, linear_dot.c on AVX512-BF16 without it,
    over their two layouts): the same values as oneDNN's own call (but for rare last-bit
    roundings of a different summation order), with and without bias, columns not a multiple
    of 32, and past 256 rows, where the kernel runs in chunks of rows (528: two whole chunks
    and 16 rows)."""
    from kvserve.models.packed_linear import kernel_rows_for

    torch.manual_seed(0)
    for out_features, in_features in [(96, 64), (40, 64), (960, 576)]:
        weight = (torch.randn(out_features, in_features) * 0.05).to(torch.bfloat16)
        bias = torch.randn(out_features).to(torch.bfloat16)
        for b in (None, bias):
            layer = PackedLinear(weight, b)
            if layer.kernel_rows == 0:
                pytest.skip("no projection kernel for this CPU")
            assert layer.kernel_rows == KERNEL_ALL_ROWS
            for rows in (1, 16, 33, 100, 128, 528):
                x = torch.randn(rows, in_features).to(torch.bfloat16)
                got = layer(x)
                layer.kernel_rows = 0
                want = layer(x)  # oneDNN
                layer.kernel_rows = KERNEL_ALL_ROWS
                assert got.shape == want.shape == (rows, out_features)
                torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)
                assert (got != want).float().mean().item() < 1e-3
    odd = torch.randn(8, 48).to(torch.bfloat16)  # 48 inputs: not a multiple of 32
    assert kernel_rows_for(odd, torch.ops.mkldnn._reorder_linear_weight(odd, None), None) == 0
    if can_pack(torch.device("cpu"), torch.float16):  # oneDNN packs fp16 on this CPU
        half = torch.randn(8, 64).to(torch.float16)
        assert kernel_rows_for(half, torch.ops.mkldnn._reorder_linear_weight(half, None), None) == 0


@pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.bfloat16), reason=NO_BF16_PACKING)
def test_threads_that_take_each_others_column_blocks_compute_the_same_bits():
    """linear_amx.c's threads take blocks from the back of each other's runs once their own is
    done: who computes a block changes, its value does not.  With more threads than blocks
    (5 threads, 3 blocks: two threads start with empty runs and steal at once) and with 8
    threads of 3 blocks each on the machine's few cores (the late ones find their runs'
    tails taken), the projection and the fused SiLU x gate equal the static halves' output
    bit for bit, and the projection equals oneDNN's values."""
    from kvserve.models.packed_linear import _kernel_linear
    from kvserve.native import ops

    kernels = ops.kernels_or_none()
    if kernels is None or kernels.set_linear_stealing(True) is None:
        pytest.skip("no AMX kernel in this build")
    torch.manual_seed(0)
    rows = torch.randn(48, 64).to(torch.bfloat16)

    def run(features: int, threads: int, stealing: int) -> tuple[torch.Tensor, torch.Tensor]:
        kernels.set_linear_stealing(bool(stealing))
        torch.set_num_threads(threads)
        linear = _kernel_linear(rows, weights[features][0], None, features)
        activated = rows.new_full((48, features), float("nan"))
        done = kernels.silu_gate_up_packed(rows, weights[features][1], activated)
        assert linear is not None and done
        return linear, activated

    weights = {  # a projection of `features` columns and a [Wg; Wu] of `features` features
        features: tuple(
            torch.ops.mkldnn._reorder_linear_weight(
                (torch.randn(n, 64) * 0.05).to(torch.bfloat16), None
            )
            for n in (features, 2 * features)
        )
        for features in (96, 768)
    }
    before = torch.get_num_threads()
    try:
        for features, threads, repeats in ((96, 1, 1), (96, 2, 1), (96, 5, 3), (768, 8, 10)):
            want = torch.ops.mkldnn._linear_pointwise(
                rows, weights[features][0], None, "none", [], ""
            )
            static = run(features, threads, 0)
            for _ in range(repeats):
                stolen = run(features, threads, 1)
                assert torch.equal(stolen[0], static[0]) and torch.equal(stolen[1], static[1])
                torch.testing.assert_close(stolen[0].float(), want.float(), atol=1e-2, rtol=1e-2)
    finally:
        kernels.set_linear_stealing(True)
        torch.set_num_threads(before)


@pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.bfloat16), reason=NO_BF16_PACKING)
def test_the_warm_up_compiles_every_graph_a_step_needs(tiny_dir):
    """After start-up no step compiles: a step whose token count is not its padded row count
    (37 tokens on 48 rows) takes the layers' padding branch, which the warm-up's 17-token
    step compiled (it used to compile in W3's second step, ~0.55 s).  The conftest model's
    head_dim of 16 keeps every step on the compiled layers (no native path)."""
    from torch._dynamo.utils import counters

    llm = LLM(tiny_dir, dtype="bfloat16", kv_cache_memory=4 * 2**20, max_model_len=256,
              enforce_eager=False, enable_prefix_caching=False)  # fmt: skip
    assert llm.engine.executor.driver_worker.model.native_layers is None
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0
    prompts = [[(i * 7919 + j) % 40000 + 7 for i in range(length)] for j, length in
               enumerate((37, 100, 150))]  # fmt: skip
    for prompt in prompts:
        llm.generate([prompt], GREEDY)
    llm.generate(prompts, GREEDY)
    assert counters["stats"]["unique_graphs"] == graphs
