"""Prefix caching and parallel sampling through the whole engine (tiny random Llama)."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
BASE = [(i * 7919) % 40000 + 7 for i in range(80)]


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_dir):
    return str(tiny_model_dir("llama3")[0])


def make(tiny_dir, caching: bool, **kw) -> LLM:
    """float32: greedy tokens compared exactly across different batch shapes; 1,100 tokens is
    past the tiny model's trained 512, which random weights do not mind (hence the override)."""
    kw.setdefault("kv_cache_memory", 16 * 2**20)
    return LLM(
        tiny_dir, enable_prefix_caching=caching, max_model_len=1100, block_size=16,
        allow_long_max_model_len=True, dtype="float32", **kw,
    )  # fmt: skip


def test_greedy_outputs_identical_with_caching_on_and_off(tiny_dir):
    prompts = [
        BASE[:64],  # 4 full blocks, seeds the cache
        BASE[:40] + [11, 12, 13],  # shares 2.5 blocks: prefix ends mid-block
        BASE[:64] + [5] * 20,  # shares all 4 full blocks
        BASE[:64],  # equals a whole cached prompt: the last token is still computed
        BASE[:16],  # exactly one block
        [3] + BASE[1:64],  # differs at token 0: no hit at all
    ]
    on, off = make(tiny_dir, True), make(tiny_dir, False)
    for prompt in prompts:  # one at a time, so later prompts find earlier ones cached
        a = on.generate([prompt], GREEDY)[0]
        b = off.generate([prompt], GREEDY)[0]
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    stats = on.engine.get_stats()
    # Hits in tokens: 0, 32 (2 blocks), 64, 48 (last token computed: 3 blocks), 0, 0.
    assert stats.prefix_cache_hits == 32 + 64 + 48
    assert stats.prefix_cache_queries == sum(len(p) for p in prompts)
    assert off.engine.get_stats().prefix_cache_queries == 0


def test_cached_token_count_is_reported_per_request(tiny_dir):
    llm = make(tiny_dir, True)
    first = llm.generate([BASE[:50]], GREEDY)[0]
    second = llm.generate([BASE[:50] + [9, 9]], GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 48


def test_n4_shares_the_prompt_blocks_once_and_matches_separate_seeded_requests(tiny_dir):
    llm = make(tiny_dir, False, kv_cache_memory=64 * 2**20)
    engine = llm.engine
    prompt = [(i * 104729) % 40000 + 3 for i in range(1000)]  # 62 full blocks + 8 tokens
    params = SamplingParams(n=4, temperature=1.0, seed=1234, max_tokens=8, ignore_eos=True)
    engine.add_request("n4", prompt, params)
    while len(engine.scheduler.running) < 4:
        engine.step()
    tables = [engine.cache_manager.block_tables[f"n4-{i}"] for i in range(4)]
    assert all(t[:62] == tables[0][:62] for t in tables)  # the same 62 full blocks ...
    assert len({t[62] for t in tables}) == 4  # ... and one private partial block each
    assert engine.cache_manager.pool.num_used_blocks == 62 + 4
    outputs = None
    while engine.has_unfinished_requests():
        outputs = [o for o in engine.step() if o.finished] or outputs
    samples = [o.token_ids for o in outputs[0].outputs]
    assert len({tuple(s) for s in samples}) > 1  # the samples differ from each other
    for i, sample in enumerate(samples):
        single = SamplingParams(temperature=1.0, seed=1234 + i, max_tokens=8, ignore_eos=True)
        assert llm.generate([prompt], single)[0].outputs[0].token_ids == sample
    assert engine.cache_manager.num_free_blocks == engine.sizing.num_blocks


SHARED = [(i * 7919) % 40000 + 7 for i in range(160)]
SHARING_PROMPTS = [SHARED + [100 + i] * (3 + i) for i in range(6)]
TEN = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def count_splits(monkeypatch) -> list[int]:
    """A list that grows by one per shared-prefix attention call (attention/shared_prefix.py)."""
    from kvserve.attention import shared_prefix

    calls: list[int] = []
    split = shared_prefix.attention_with_lse

    def counting(*args, **kwargs):
        calls.append(1)
        return split(*args, **kwargs)

    monkeypatch.setattr(shared_prefix, "attention_with_lse", counting)
    return calls


def attended_whole(tiny_dir, monkeypatch) -> list[list[int]]:
    """SHARING_PROMPTS' greedy tokens with the split turned off (each sequence whole)."""
    from kvserve.attention import shared_prefix

    monkeypatch.setattr(shared_prefix, "MIN_SHARED_TOKENS", 10**9)
    return [o.outputs[0].token_ids for o in make(tiny_dir, True).generate(SHARING_PROMPTS, TEN)]


def test_shared_prefix_attended_once_gives_the_same_tokens(tiny_dir, monkeypatch):
    """Six requests on one 160-token prefix, run together: every prefill of a suffix and
    every decode splits attention at the shared blocks (attention/shared_prefix.py).  The
    greedy tokens equal those of the same requests attended whole."""
    calls = count_splits(monkeypatch)
    llm = make(tiny_dir, True)
    llm.generate([SHARED], GREEDY)  # the prefix is cached before the six arrive
    together = [o.outputs[0].token_ids for o in llm.generate(SHARING_PROMPTS, TEN)]
    assert calls  # the split was taken
    assert together == attended_whole(tiny_dir, monkeypatch)


def test_the_step_computing_the_prefix_lets_the_others_share_it(tiny_dir, monkeypatch):
    """Six requests on one 160-token prefix that nobody has cached, all added at once: the
    first step computes the prefix for one of them, while the others (admitted in the same
    step) read it through the split (attention/shared_prefix.py), the computing chunk on its
    usual path.  The greedy tokens equal those of the same requests attended whole."""
    calls = count_splits(monkeypatch)
    engine = make(tiny_dir, True).engine
    for i, prompt in enumerate(SHARING_PROMPTS):
        engine.add_request(f"r{i}", prompt, TEN)
    engine.step()
    assert calls  # the first step split already
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = out.outputs[0].token_ids
    together = [tokens[f"r{i}"] for i in range(6)]
    assert together == attended_whole(tiny_dir, monkeypatch)
