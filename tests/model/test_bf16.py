"""The bfloat16 path, which `--dtype auto` takes on a CPU with native bf16 (AVX512-BF16/AMX):
tiny random models against transformers run in bfloat16 too, and the engine's paths (chunked
prefill, prefix caching, n > 1, both attention backends) in bfloat16.  The last tests run
`--dtype auto` under KVSERVE_CPU_NATIVE_BF16=0 and =1, so both auto paths run on any CPU.

The models are the conftest ones with initializer_range 0.1 (SHARP) instead of 0.02: their
attention is sharp, so a position or cache error moves the logits by far more than bfloat16
rounding does (a RoPE base 3x off: max logit error 0.97-2.6 against 0.05 from rounding; with
0.02 weights the same error hides under one bf16 ulp).

Why tolerances and not exact tokens: our logits come out of a bfloat16 LM head, so they sit on
the bfloat16 grid (one ulp is 2^-6 = 0.016 at |logit| in [2, 4), where these logits lie), and
a different summation order (transformers vs ours, a chunk vs one shot, a batch of 3 vs 1, the
C kernel vs SDPA) moves a logit by an ulp or three.  Random models have top-1 margins of that
size, so two correct bf16 runs can pick different greedy tokens at a near-tie (seen: the two
attention backends at the second token).  Hence:

* logits: max |ours - transformers (bf16)| < LOGIT_TOL = 0.15 (seen: 0.055; transformers'
  own bf16 vs float32 logits differ by 0.056);
* top-1 under teacher forcing: at every position the token we pick has a reference logit
  within LOGIT_TOL of the reference maximum (our pick is a reference argmax up to a near-tie);
* two engine runs agree when their greedy tokens are equal with logprobs within LOGPROB_TOL =
  0.1 (seen: <= 0.016), up to a first divergence that is itself a near-tie in both runs
  (assert_greedy_agrees).
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from helpers import run_in_chunks

from kvserve import LLM, SamplingParams
from kvserve.attention.kv_cache import kv_cache_bytes
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.loader import load_checkpoint
from kvserve.native import platform
from kvserve.step import CompletionOutput, TokenLogprobs

SHARP = 0.1  # initializer_range of the tiny models here
LOGIT_TOL = 0.15
LOGPROB_TOL = 0.1
ARCHS = ["llama3", "qwen2", "mistral"]
PROMPT = [1, 504, 3224, 282, 4649, 314, 5483, 30, 2] + list(range(1000, 1130, 3))  # 53 tokens
BASE = [(i * 7919) % 40000 + 7 for i in range(80)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def bf16_pair(tiny_model_dir):
    """arch -> (directory, transformers model in bfloat16); the shared float32 one untouched."""
    made = {}

    def get(arch: str):
        if arch not in made:
            directory, hf = tiny_model_dir(arch, initializer_range=SHARP)
            made[arch] = (directory, copy.deepcopy(hf).to(torch.bfloat16))
        return made[arch]

    return get


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_dir) -> str:
    return str(tiny_model_dir("llama3", initializer_range=SHARP)[0])


def bf16_llm(directory, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", 4 * 2**20)
    kw.setdefault("max_model_len", 256)
    return LLM(str(directory), dtype="bfloat16", block_size=16, **kw)


def our_bf16_model(directory) -> LlamaForCausalLM:
    ckpt = load_checkpoint(str(directory))
    return LlamaForCausalLM.from_weights(
        ckpt.config, ckpt.weights, torch.bfloat16, torch.device("cpu")
    )


def reference_logits(hf, token_ids: list[int]) -> torch.Tensor:
    """transformers' logits [L, vocab] as float32."""
    with torch.no_grad():
        return hf(torch.tensor([token_ids])).logits[0].float()


def assert_picks_are_reference_argmax(picks: torch.Tensor, ref: torch.Tensor) -> None:
    """picks [L] token ids; ref [L, vocab]: each pick within LOGIT_TOL of the row's maximum."""
    picked = ref.gather(1, picks[:, None])[:, 0]
    gap = ref.max(dim=-1).values - picked
    assert gap.max().item() < LOGIT_TOL, gap


def assert_greedy_agrees(a: CompletionOutput, b: CompletionOutput) -> int:
    """Equal greedy tokens with logprobs within LOGPROB_TOL, up to the first step where the runs
    pick different tokens, which must be a near-tie in both runs.  Returns the equal prefix."""
    assert a.logprobs is not None and b.logprobs is not None, "ask for logprobs"
    for step, (x, y) in enumerate(zip(a.logprobs, b.logprobs, strict=True)):
        assert abs(x.logprob - y.logprob) < LOGPROB_TOL, (step, x, y)
        if x.token_id != y.token_id:
            assert near_tie(x, y.token_id) and near_tie(y, x.token_id), (step, x, y)
            return step
    return len(a.logprobs)


def near_tie(picked: TokenLogprobs, other_id: int) -> bool:
    """`other_id` is within LOGPROB_TOL of the picked token in that step's top list, or is not
    listed while every listed token is (more near-ties than the list holds)."""
    top = dict(picked.top)
    return top.get(other_id, min(top.values())) > picked.logprob - LOGPROB_TOL


# --------------------------------------------------------------- parity with transformers
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_and_top1_match_transformers_in_bf16(bf16_pair, arch):
    directory, hf = bf16_pair(arch)
    ours = run_in_chunks(our_bf16_model(directory), PROMPT, chunk_size=len(PROMPT))
    ref = reference_logits(hf, PROMPT)
    assert (ours - ref).abs().max().item() < LOGIT_TOL
    assert_picks_are_reference_argmax(ours.argmax(dim=-1), ref)


@pytest.mark.parametrize("arch", ARCHS)
def test_engine_greedy_tokens_are_transformers_argmax_in_bf16(bf16_pair, arch):
    """32 greedy tokens from the engine (paged cache in bf16, decode attention included), then
    transformers run on prompt + those tokens: each token is its argmax up to a near-tie."""
    directory, hf = bf16_pair(arch)
    llm = bf16_llm(directory)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    tokens = llm.generate([PROMPT], params)[0].outputs[0].token_ids
    assert len(tokens) == 32
    ref = reference_logits(hf, PROMPT + tokens[:-1])[len(PROMPT) - 1 :]
    assert_picks_are_reference_argmax(torch.tensor(tokens), ref)


# --------------------------------------------------------------- the engine in bf16
def test_the_kv_cache_is_stored_in_bf16_at_half_the_bytes(tiny_dir):
    """Tiny llama: 2 (K, V) x 2 layers x 2 KV heads x 16 dims x 2 bytes = 256 bytes/token,
    half of float32's 512, so the same memory holds twice the blocks."""
    bf16 = bf16_llm(tiny_dir, kv_cache_memory=2**20).engine
    fp32 = LLM(tiny_dir, dtype="float32", kv_cache_memory=2**20, max_model_len=256).engine
    caches = bf16.executor.kv_caches
    assert bf16.executor.dtype == torch.bfloat16 and caches[0].key.dtype == torch.bfloat16
    assert bf16.sizing.spec.dtype == "bfloat16" and "bfloat16" in bf16.sizing.summary()
    assert bf16.sizing.spec.bytes_per_token == 2 * 2 * 2 * 16 * 2 == 256
    assert fp32.sizing.spec.bytes_per_token == 2 * bf16.sizing.spec.bytes_per_token
    assert bf16.sizing.num_blocks == 2**20 // (16 * 256) == 2 * fp32.sizing.num_blocks
    assert kv_cache_bytes(caches) == bf16.sizing.num_blocks * 16 * 256


@pytest.mark.parametrize("chunk_size", [7, 1, 16])
def test_chunked_prefill_equals_one_shot_in_bf16(tiny_dir, chunk_size):
    model = our_bf16_model(tiny_dir)
    one_shot = run_in_chunks(model, PROMPT, chunk_size=len(PROMPT))
    chunked = run_in_chunks(model, PROMPT, chunk_size=chunk_size)
    assert one_shot.dtype == torch.float32  # logits are upcast from the bf16 LM head
    assert (chunked - one_shot).abs().max().item() < LOGIT_TOL


def test_engine_chunked_prefill_and_attention_backends_agree_in_bf16(tiny_dir):
    """A 16-token step budget splits the 53-token prompt in 4 chunks; the PyTorch reference
    attention agrees with the default backend (the C kernel where gcc is found)."""
    one_shot = bf16_llm(tiny_dir).generate([PROMPT], GREEDY)[0].outputs[0]
    chunked = bf16_llm(tiny_dir, max_num_batched_tokens=16, max_num_seqs=4)
    assert_greedy_agrees(one_shot, chunked.generate([PROMPT], GREEDY)[0].outputs[0])
    reference = bf16_llm(tiny_dir, attention_backend="torch")
    assert_greedy_agrees(one_shot, reference.generate([PROMPT], GREEDY)[0].outputs[0])


def test_prefix_caching_in_bf16(tiny_dir):
    """The same prompts as the float32 test (test_prefix_caching.py): the same hits, and each
    output agrees with the uncached run."""
    prompts = [BASE[:64], BASE[:40] + [11, 12, 13], BASE[:64] + [5] * 20, BASE[:64], BASE[:16]]
    on = bf16_llm(tiny_dir, enable_prefix_caching=True)
    off = bf16_llm(tiny_dir, enable_prefix_caching=False)
    for prompt in prompts:
        cached = on.generate([prompt], GREEDY)[0].outputs[0]
        assert_greedy_agrees(off.generate([prompt], GREEDY)[0].outputs[0], cached)
    assert on.engine.get_stats().prefix_cache_hits == 32 + 64 + 48
    assert on.engine.cache_manager.num_free_blocks == on.engine.sizing.num_blocks


def test_n3_shares_the_prompt_blocks_and_agrees_with_one_request_in_bf16(tiny_dir):
    """n=3 greedy forks 6 full prompt blocks + a partial one (copied on write, in bf16)."""
    llm = bf16_llm(tiny_dir, enable_prefix_caching=False)
    engine = llm.engine
    prompt = [(i * 104729) % 40000 + 3 for i in range(100)]  # 6 full blocks + 4 tokens
    engine.add_request("n3", prompt, replace(GREEDY, n=3))
    while len(engine.scheduler.running) < 3:
        engine.step()
    tables = [engine.cache_manager.block_tables[f"n3-{i}"] for i in range(3)]
    assert all(t[:6] == tables[0][:6] for t in tables) and len({t[6] for t in tables}) == 3
    outputs = None
    while engine.has_unfinished_requests():
        outputs = [o for o in engine.step() if o.finished] or outputs
    alone = llm.generate([prompt], GREEDY)[0].outputs[0]
    for sample in outputs[0].outputs:
        assert_greedy_agrees(alone, sample)
    assert engine.cache_manager.num_free_blocks == engine.sizing.num_blocks


# --------------------------------------------------------------- --dtype auto, both ways
@pytest.mark.parametrize(("native", "expected"), [("0", torch.float32), ("1", torch.bfloat16)])
def test_auto_dtype_follows_the_native_bf16_switch(tiny_dir, monkeypatch, native, expected):
    """KVSERVE_CPU_NATIVE_BF16 decides what auto means on a CPU, whatever this CPU has; the
    auto run is the explicit-dtype run, token for token."""
    monkeypatch.setenv(platform.NATIVE_BF16_ENV, native)
    assert platform.cpu_has_native_bf16() is (native == "1")
    assert platform.resolve_dtype("auto", torch.device("cpu"), "float32") == expected
    name = str(expected).removeprefix("torch.")
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    auto = LLM(tiny_dir, dtype="auto", kv_cache_memory=2**20, max_model_len=256)
    executor = auto.engine.executor
    assert executor.dtype == expected and executor.kv_caches[0].key.dtype == expected
    assert auto.engine.sizing.spec.bytes_per_token == (512 if native == "0" else 256)
    explicit = LLM(tiny_dir, dtype=name, kv_cache_memory=2**20, max_model_len=256)
    got = auto.generate([PROMPT, BASE[:30]], params)
    want = explicit.generate([PROMPT, BASE[:30]], params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_native_bf16_switch_rejects_other_values(monkeypatch):
    monkeypatch.setenv(platform.NATIVE_BF16_ENV, "yes")
    with pytest.raises(ValueError, match="KVSERVE_CPU_NATIVE_BF16 must be 0 or 1"):
        platform.cpu_has_native_bf16()
    monkeypatch.setenv(platform.NATIVE_BF16_ENV, "")
    assert isinstance(platform.cpu_has_native_bf16(), bool)  # empty: detect
