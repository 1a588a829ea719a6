"""Scheduler with a fake runner: exact steps, chunked prefill, preemption, property tests."""

from __future__ import annotations

import math
import random

import pytest
from fake_runner import FakeRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.engine import scheduler as scheduler_module
from kvserve.engine.scheduler import Scheduler
from kvserve.kv.cache_manager import KVCacheManager
from kvserve.request import Request, RequestStatus, SamplingParams


def make_scheduler(num_blocks=64, block_size=4, budget=32, max_seqs=16, max_len=256, caching=True):
    cm = KVCacheManager(num_blocks, block_size, enable_caching=caching)
    return Scheduler(max_seqs, budget, max_len, cm)


def request(rid: str, prompt_len: int, max_tokens: int, offset: int = 0) -> Request:
    prompt = [(offset + i * 13) % 500 + 1 for i in range(prompt_len)]
    return Request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens))


def run(
    scheduler: Scheduler, runner: FakeRunner, check=None, max_steps=10_000
) -> dict[str, list[int]]:
    """Step until every request finished; returns output tokens by request id."""
    tracked = dict(scheduler.requests)
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            break
        out = scheduler.schedule()
        scheduler.update_from_output(out, runner.execute(out))
        if check:
            check(scheduler)
    assert not scheduler.has_unfinished_requests()
    return {rid: r.output_token_ids for rid, r in tracked.items()}


def test_chunked_prefill_splits_exactly_at_the_budget_and_decodes_go_first():
    s = make_scheduler(budget=8)
    runner = FakeRunner(s.cache_manager.block_size)
    s.add_request(request("a", 3, 5))
    out = s.schedule()
    assert [(x.request_id, x.num_tokens) for x in out.scheduled] == [("a", 3)]
    s.update_from_output(out, runner.execute(out))
    s.add_request(request("b", 20, 2))
    steps = []
    for _ in range(3):
        out = s.schedule()
        steps.append([(x.request_id, x.num_tokens, x.sample) for x in out.scheduled])
        s.update_from_output(out, runner.execute(out))
    assert steps == [
        [("a", 1, True), ("b", 7, False)],
        [("a", 1, True), ("b", 7, False)],
        [("a", 1, True), ("b", 6, True)],
    ]


def test_max_num_seqs_caps_the_batch():
    s = make_scheduler(max_seqs=2, budget=100)
    for i in range(3):
        s.add_request(request(f"r{i}", 4, 3))
    out = s.schedule()
    assert [x.request_id for x in out.scheduled] == ["r0", "r1"]
    assert [r.request_id for r in s.waiting] == ["r2"]


def test_request_that_can_never_fit_is_rejected_at_submission():
    s = make_scheduler(max_len=64)
    with pytest.raises(
        ValueError,
        match=r"max_tokens \(10\) \+ prompt \(60 tokens\) = 70 exceeds max_model_len \(64\)",
    ):
        s.add_request(request("x", 60, 10))
    assert not s.has_unfinished_requests()
    with pytest.raises(ValueError, match="at least one token"):
        s.add_request(Request("e", [], SamplingParams()))


@pytest.mark.parametrize("caching", [True, False])
def test_preemption_keeps_outputs_identical_and_frees_everything(caching):
    reqs = [(f"r{i}", 10 + 3 * i, 20 + i) for i in range(12)]
    alone = {}
    for rid, n, m in reqs:
        s = make_scheduler(num_blocks=64, caching=caching)
        s.add_request(request(rid, n, m, offset=len(rid) * 7 + n))
        alone.update(run(s, FakeRunner(s.cache_manager.block_size)))
    s = make_scheduler(num_blocks=24, budget=64, caching=caching)  # ~2-3 sequences' worth
    for rid, n, m in reqs:
        s.add_request(request(rid, n, m, offset=len(rid) * 7 + n))
    outputs = run(
        s,
        FakeRunner(s.cache_manager.block_size),
        check=lambda sch: sch.cache_manager.check_invariants(),
    )
    assert s.num_preemptions > 0
    assert outputs == alone
    assert s.cache_manager.num_free_blocks == 24
    assert s.cache_manager.usage == 0.0


def test_preempted_request_resumes_from_its_cached_prefix():
    s = make_scheduler(num_blocks=10, block_size=4, budget=64)
    s.add_request(request("a", 16, 8))
    s.add_request(request("b", 16, 8, offset=3))
    run(s, FakeRunner(s.cache_manager.block_size))
    assert s.num_preemptions > 0
    assert s.cache_manager.prefix_stats.hits > 0  # recompute found its own full blocks


def test_abort_frees_blocks_at_once():
    s = make_scheduler()
    s.add_request(request("a", 10, 50))
    out = s.schedule()
    s.update_from_output(out, FakeRunner(s.cache_manager.block_size).execute(out))
    assert s.cache_manager.num_free_blocks < 64
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert s.cache_manager.num_free_blocks == 64
    assert s.schedule().finished_request_ids == ["a"]
    s.cache_manager.check_invariants()


def test_kv_waste_of_a_long_tailed_mix_is_exact_and_under_4_percent():
    rng = random.Random(7)
    lengths = [max(1, min(4000, int(rng.lognormvariate(5.4, 0.8)))) for _ in range(1000)]
    assert 250 < sum(lengths) / len(lengths) < 350  # mean about 300 tokens
    total_blocks = sum(math.ceil(n / 16) for n in lengths)
    s = make_scheduler(num_blocks=total_blocks, block_size=16, budget=sum(lengths),
                       max_seqs=1000, max_len=5000, caching=False)  # fmt: skip
    for i, n in enumerate(lengths):
        s.add_request(request(f"r{i}", n, 100, offset=i))
    out = s.schedule()
    assert len(out.scheduled) == 1000
    s.update_from_output(out, FakeRunner(s.cache_manager.block_size).execute(out))
    expected = 1 - sum(lengths) / (total_blocks * 16)
    assert s.stats().kv_waste == pytest.approx(expected, abs=1e-12)
    assert s.stats().kv_waste < 0.04
    assert s.stats().kv_cache_usage == 1.0


@settings(max_examples=80, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 4, 8, 16]),
    extra_blocks=st.integers(0, 40),
    budget=st.integers(1, 64),
    max_seqs=st.integers(1, 8),
    caching=st.booleans(),
    arrivals=st.lists(
        st.tuples(st.integers(0, 6), st.integers(1, 40), st.integers(1, 20), st.integers(0, 3)),
        min_size=1, max_size=12,
    ),
)  # fmt: skip
def test_invariants_hold_after_every_step(
    block_size, extra_blocks, budget, max_seqs, caching, arrivals
):
    max_len = 64
    num_blocks = math.ceil(max_len / block_size) + extra_blocks
    s = make_scheduler(num_blocks, block_size, budget, max_seqs, max_len, caching)
    runner = FakeRunner(s.cache_manager.block_size)
    pending = sorted(
        ((step, f"r{i}", n, m, shared) for i, (step, n, m, shared) in enumerate(arrivals)),
        key=lambda x: x[0],
    )
    step = 0
    while pending or s.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, rid, n, m, shared = pending.pop(0)
            s.add_request(request(rid, n, m, offset=shared))  # equal offsets share prefixes
        out = s.schedule()
        assert out.num_scheduled_tokens <= budget
        assert len(s.running) <= max_seqs
        s.update_from_output(out, runner.execute(out))
        _check_ownership(s, caching)
        step += 1
        assert step < 5000
    assert s.cache_manager.num_free_blocks == num_blocks


def _check_ownership(s: Scheduler, caching: bool) -> None:
    cm = s.cache_manager
    cm.check_invariants()  # free + used = total, ref counts = tables holding each block
    for r in s.running:
        assert cm.num_blocks_of(r.request_id) == math.ceil(r.num_computed_tokens / cm.block_size)
    for r in s.waiting:
        assert cm.num_blocks_of(r.request_id) == 0
    if not caching:
        owned = [b for t in cm.block_tables.values() for b in t]
        assert len(owned) == len(set(owned)), "a block is owned twice"


def forked(rid: str, source: Request) -> Request:
    return Request(
        rid, list(source.prompt_token_ids), source.sampling_params, fork_of=source.request_id
    )


@pytest.mark.parametrize("caching", [True, False])
def test_parallel_samples_share_prompt_blocks_and_copy_the_partial_one(caching):
    s = make_scheduler(num_blocks=64, block_size=4, budget=64, caching=caching)
    src = request("p", 10, 6)  # 2 full blocks + 2 tokens
    s.add_request(src)
    for i in (1, 2, 3):
        s.add_request(forked(f"p-{i}", src))
    assert s.stats().num_waiting == 4
    runner = FakeRunner(4)
    out = s.schedule()
    assert [(x.request_id, x.num_tokens) for x in out.scheduled] == [("p", 10)]
    s.update_from_output(out, runner.execute(out))
    cm = s.cache_manager
    # The siblings now share all 3 prompt blocks by reference.
    assert [cm.pool.blocks[b].ref_cnt for b in cm.block_tables["p"]] == [4, 4, 4]
    out = s.schedule()
    # The source decodes; each sibling recomputes only the last prompt token.
    assert [(x.request_id, x.num_tokens, x.start_position) for x in out.scheduled] == [
        ("p", 1, 10), ("p-1", 1, 9), ("p-2", 1, 9), ("p-3", 1, 9),
    ]  # fmt: skip
    # Three of the four writers copy the shared partial block; the last one owns it alone.
    assert [src_block for src_block, _ in out.block_copies] == [2, 2, 2]
    tables = [cm.block_tables[r] for r in ("p", "p-1", "p-2", "p-3")]
    assert all(t[:2] == [0, 1] for t in tables)
    assert len({t[2] for t in tables}) == 4
    assert cm.pool.num_used_blocks == 2 + 4
    s.update_from_output(out, runner.execute(out))
    cm.check_invariants()
    outputs = run(s, runner, check=lambda sch: sch.cache_manager.check_invariants())
    alone = make_scheduler(caching=caching)
    alone.add_request(request("x", 10, 6))
    expected = run(alone, FakeRunner(4))["x"]
    assert outputs == {rid: expected for rid in ("p", "p-1", "p-2", "p-3")}
    assert cm.num_free_blocks == 64


def test_siblings_of_an_aborted_source_compute_their_own_prompt():
    s = make_scheduler(block_size=4)
    src = request("p", 10, 4)
    s.add_request(src)
    s.add_request(forked("p-1", src))
    s.finish_request("p", RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in s.waiting] == ["p-1"]
    outputs = run(s, FakeRunner(4))
    assert len(outputs["p-1"]) == 4


def test_request_reads_a_prefix_computed_in_the_same_step():
    """b's first 2 blocks are a's, which a computes in this very step: b is admitted in the
    same step over a's blocks and computes only its own 3 tokens (every token of a step is
    written before any is read, which the fake runner models); its tokens equal b's alone."""
    s = make_scheduler(block_size=4, budget=64)
    shared = list(range(1, 9))  # 2 full blocks
    s.add_request(Request("a", shared + [20, 21], SamplingParams(max_tokens=2)))
    s.add_request(Request("b", shared + [30, 31, 32], SamplingParams(max_tokens=2)))
    s.add_request(Request("c", [99] * 6, SamplingParams(max_tokens=2)))  # unrelated
    runner = FakeRunner(4)
    out = s.schedule()
    assert [(x.request_id, x.num_tokens, x.start_position) for x in out.scheduled] == [
        ("a", 10, 0), ("b", 3, 8), ("c", 6, 0)
    ]  # fmt: skip
    table = {x.request_id: x.block_table for x in out.scheduled}
    assert table["b"][:2] == table["a"][:2]
    assert s.requests["b"].num_cached_tokens == 8
    s.update_from_output(out, runner.execute(out))
    outputs = run(s, runner)
    alone = make_scheduler(block_size=4, budget=64)
    alone.add_request(Request("b", shared + [30, 31, 32], SamplingParams(max_tokens=2)))
    assert outputs["b"] == run(alone, FakeRunner(4))["b"]


def test_only_the_blocks_a_chunk_completes_in_the_step_are_shared():
    """a's 13-token prompt is chunked (budget 9): step 1 completes its blocks 0-1 and half of
    block 2, so b (same 12 tokens, then its own) waits behind the budget; in step 2 a
    finishes block 2 and b, admitted beside it, reads blocks 0-1 from the cache and block 2
    from a's step: it computes its last token only."""
    s = make_scheduler(block_size=4, budget=9)
    shared = list(range(1, 13))  # 3 full blocks
    s.add_request(Request("a", shared + [20], SamplingParams(max_tokens=1)))
    b = Request("b", shared + [30], SamplingParams(max_tokens=1))
    s.add_request(b)
    runner = FakeRunner(4)
    out = s.schedule()
    assert [(x.request_id, x.num_tokens, x.start_position) for x in out.scheduled] == [("a", 9, 0)]
    s.update_from_output(out, runner.execute(out))
    out = s.schedule()
    assert [(x.request_id, x.num_tokens, x.start_position) for x in out.scheduled] == [
        ("a", 4, 9), ("b", 1, 12)
    ]  # fmt: skip
    table = {x.request_id: x.block_table for x in out.scheduled}
    assert table["b"][:3] == table["a"][:3]
    s.update_from_output(out, runner.execute(out))
    run(s, runner)
    alone = make_scheduler(block_size=4, budget=9)
    alone.add_request(Request("b", shared + [30], SamplingParams(max_tokens=1)))
    assert b.output_token_ids == run(alone, FakeRunner(4))["b"]


DEFAULT_RESERVE_STEP = scheduler_module.GROWTH_RESERVE_STEP


def _equal_length_run(monkeypatch, step: float) -> tuple[Scheduler, dict[str, list[int]]]:
    """16 requests of 16 + 16 tokens in a cache holding 4 of them at full length."""
    monkeypatch.setattr(scheduler_module, "GROWTH_RESERVE_STEP", step)
    s = make_scheduler(num_blocks=32, block_size=4, budget=64)
    for i in range(16):
        s.add_request(request(f"r{i}", 16, 16, offset=i * 31))
    outputs = run(
        s, FakeRunner(s.cache_manager.block_size), lambda x: x.cache_manager.check_invariants()
    )
    return s, outputs


def test_growth_reserve_stops_admit_grow_preempt_thrash(monkeypatch):
    thrash, expected = _equal_length_run(monkeypatch, 0.0)  # admit while blocks last
    reserved, outputs = _equal_length_run(monkeypatch, DEFAULT_RESERVE_STEP)
    assert outputs == expected
    # Without a reserve every wave over-admits (prompts fit 8, full lengths only 4) and
    # preempts; with it, the first preemptions raise the reserve and later waves fit.
    assert thrash.num_preemptions >= 8
    assert 0 < reserved.num_preemptions <= thrash.num_preemptions // 2
    assert reserved.cache_manager.num_free_blocks == 32


def test_growth_reserve_is_zero_until_a_preemption_and_decays():
    s = make_scheduler(num_blocks=64, block_size=4, budget=64)
    s.add_request(request("a", 8, 4))
    s.schedule()
    assert s.growth_reserve == 0.0
    s.growth_reserve = 0.01
    for _ in range(10):
        s.schedule()
    assert s.growth_reserve == pytest.approx(
        max(0.0, 0.01 - 10 * scheduler_module.GROWTH_RESERVE_DECAY)
    )


def test_grammar_stops_end_sequences_and_win_over_max_tokens():
    """update_from_output's grammar_stops (structured/): a complete grammar stops a sequence
    without EOS, with "stop" even on its max_tokens-th token; an aborted one is "abort"."""
    s = make_scheduler()
    runner = FakeRunner(4)
    for rid, max_tokens in (("done", 2), ("at_max", 2), ("early", 5), ("broken", 5)):
        s.add_request(request(rid, 3, max_tokens))
    out = s.schedule()
    s.update_from_output(out, runner.execute(out))  # one token each, nothing ends
    out = s.schedule()
    stops = {
        "at_max": RequestStatus.FINISHED_STOPPED,
        "early": RequestStatus.FINISHED_STOPPED,
        "broken": RequestStatus.FINISHED_ABORTED,
    }
    updated = s.update_from_output(out, runner.execute(out), stops)
    statuses = {r.request_id: r.status for r in updated}
    assert statuses == {
        "done": RequestStatus.FINISHED_LENGTH,  # no grammar said anything: max_tokens
        "at_max": RequestStatus.FINISHED_STOPPED,
        "early": RequestStatus.FINISHED_STOPPED,  # 2 of its 5 tokens
        "broken": RequestStatus.FINISHED_ABORTED,
    }
    assert all(r.num_output_tokens == 2 for r in updated)
    assert not s.has_unfinished_requests() and s.cache_manager.num_free_blocks == 64
