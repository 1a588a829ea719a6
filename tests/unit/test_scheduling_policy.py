"""--scheduling-policy: lpm's order and its aging bound, priority's order and preemption victim,
and duplicate prefills of one uncached prefix, with exact cached token counts."""

from __future__ import annotations

import pytest
from fake_runner import FakeRunner

from kvserve.config import SchedulerConfig
from kvserve.engine import scheduling_policy
from kvserve.engine.scheduler import Scheduler
from kvserve.engine.scheduling_policy import WaitingOrder
from kvserve.errors import ParameterError
from kvserve.kv.cache_manager import KVCacheManager
from kvserve.request import Request, SamplingParams

BLOCK = 4
PREFIX = [7 + 3 * i for i in range(16)]  # 4 full blocks


class Clock:
    """A settable clock for the aging bound (seconds on Request.arrival_time's scale)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(policy: str, num_blocks=64, budget=64, max_seqs=1, max_wait_s=5.0, clock=None):
    cm = KVCacheManager(num_blocks, BLOCK)
    order = WaitingOrder(policy, max_wait_s, clock or Clock())
    return Scheduler(max_seqs, budget, 256, cm, order)


def req(rid: str, prompt: list[int], arrival: float, max_tokens=1, priority=0) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return Request(rid, prompt, params, arrival_time=arrival, priority=priority)


def unique(seed: int, n: int = 6) -> list[int]:
    return [1000 + seed * 50 + i for i in range(n)]


def step(s: Scheduler, runner: FakeRunner) -> list[tuple[str, int]]:
    out = s.schedule()
    s.update_from_output(out, runner.execute(out))
    return [(x.request_id, x.num_tokens) for x in out.scheduled]


def drain(s: Scheduler, runner: FakeRunner) -> None:
    while s.has_unfinished_requests():
        step(s, runner)
    s.cache_manager.check_invariants()


def warmed(policy: str, **kwargs) -> tuple[Scheduler, FakeRunner]:
    """A scheduler whose prefix cache holds PREFIX's 4 blocks (a finished request's)."""
    s = make(policy, **kwargs)
    runner = FakeRunner(BLOCK)
    s.add_request(req("warm", PREFIX + unique(0), -1.0))
    drain(s, runner)
    return s, runner


@pytest.mark.parametrize("policy, first", [("fcfs", "cold"), ("lpm", "hot")])
def test_lpm_admits_the_longest_cached_prefix_first(policy, first):
    s, runner = warmed(policy)
    cold, hot = req("cold", unique(1, 20), 0.0), req("hot", PREFIX + unique(2), 1.0)
    s.add_request(cold)
    s.add_request(hot)
    assert step(s, runner) == [(first, 6 if first == "hot" else 20)]
    drain(s, runner)
    assert (cold.num_cached_tokens, hot.num_cached_tokens) == (0, 16)


def test_lpm_keeps_arrival_order_among_equal_prefixes():
    s, runner = warmed("lpm", max_seqs=4)
    for i, rid in enumerate(["c1", "h1", "c2", "h2"]):
        prompt = (PREFIX if rid[0] == "h" else []) + unique(i + 1)
        s.add_request(req(rid, prompt, float(i)))
    assert [rid for rid, _ in step(s, runner)] == ["h1", "h2", "c1", "c2"]


def test_an_aged_request_goes_first_exactly_at_the_bound():
    """A stream of hot requests (one arriving per second) cannot hold back the cold one past
    max_wait_s: it is admitted at the first step where it has waited 5 s, not before."""
    clock = Clock()
    s, runner = warmed("lpm", clock=clock)
    s.add_request(req("cold", unique(9, 20), 0.0))
    admitted_at = {}
    for t in range(8):
        clock.now = float(t)
        s.add_request(req(f"hot{t}", PREFIX + unique(t + 10), float(t)))
        for rid, _ in step(s, runner):
            admitted_at.setdefault(rid, t)
    assert admitted_at["cold"] == 5
    assert [admitted_at[f"hot{t}"] for t in range(5)] == [0, 1, 2, 3, 4]


def test_lpm_ranks_only_the_first_window_of_the_queue(monkeypatch):
    monkeypatch.setattr(scheduling_policy, "LPM_WINDOW", 2)
    s, runner = warmed("lpm")
    s.add_request(req("c1", unique(1), 0.0))
    s.add_request(req("c2", unique(2), 1.0))
    s.add_request(req("hot", PREFIX + unique(3), 2.0))  # third: not ranked
    assert step(s, runner) == [("c1", 6)]


def test_priority_admits_lower_values_first_ties_by_arrival():
    s = make("priority", max_seqs=3)
    runner = FakeRunner(BLOCK)
    for rid, priority, arrival in [("a", 2, 0.0), ("b", 0, 1.0), ("c", 1, 2.0), ("d", 0, 3.0)]:
        s.add_request(req(rid, unique(ord(rid)), arrival, priority=priority))
    assert [rid for rid, _ in step(s, runner)] == ["b", "d", "c"]


@pytest.mark.parametrize("policy, victim", [("fcfs", "a"), ("priority", "c")])
def test_the_preemption_victim(policy, victim):
    """Pool of 4 blocks, two running requests of 2 blocks each: the first decode that needs a
    third block preempts the newest (fcfs) or the highest (priority, arrival) (vLLM's)."""
    s = make(policy, num_blocks=4, max_seqs=2)
    runner = FakeRunner(BLOCK)
    s.add_request(req("c", unique(1, 7), 0.0, max_tokens=8, priority=int(policy == "priority")))
    step(s, runner)  # c alone: its prompt
    s.add_request(req("a", unique(2, 7), 1.0, max_tokens=8))
    preempted = []
    while not preempted:
        out = s.schedule()
        preempted = out.preempted_request_ids
        s.update_from_output(out, runner.execute(out))
    assert preempted == [victim]


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_a_priority_is_refused_unless_the_policy_is_priority(policy):
    s = make(policy)
    with pytest.raises(ParameterError, match="--scheduling-policy priority") as caught:
        s.add_request(req("x", unique(1), 0.0, priority=3))
    assert caught.value.param == "priority" and not s.requests


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
@pytest.mark.parametrize("budget", [64, 8])
def test_duplicates_of_an_uncached_prefix_compute_it_once(policy, budget):
    """Two requests share an uncached 16-token prefix.  With a large budget both are admitted
    in one step and the second reads the blocks the first computes in it; with a budget of 8
    the first's chunks use the whole budget, so the second waits and then finds them cached.
    Either way it computes only its own suffix; a request of another prefix is not held."""
    s = make(policy, budget=budget, max_seqs=4)
    runner = FakeRunner(BLOCK)
    second = req("second", PREFIX + unique(2), 1.0)
    s.add_request(req("first", PREFIX + unique(1), 0.0))
    s.add_request(second)
    s.add_request(req("other", unique(3, 10), 2.0))
    steps = []
    while s.has_unfinished_requests():
        steps.append(step(s, runner))
    assert s.requests == {}
    computed = {}
    for scheduled in steps:
        for rid, num in scheduled:
            computed[rid] = computed.get(rid, 0) + num
    assert computed == {"first": 22, "second": 6, "other": 10}
    assert second.num_cached_tokens == 16
    if budget == 64:
        assert steps[0] == [("first", 22), ("second", 6), ("other", 10)]
    s.cache_manager.check_invariants()


def test_an_unknown_policy_is_refused_naming_the_flag():
    with pytest.raises(ParameterError, match="--scheduling-policy must be one of fcfs, priority"):
        SchedulerConfig(scheduling_policy="sjf")
