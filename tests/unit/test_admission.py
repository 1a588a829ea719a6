"""Admission to the lower tiers gated on reuse (kv/admission.py, --kv-offloading-store-threshold)
measured on small traces (kvserve/bench/kv_sim.py), and the tier an `evicted` miss fell out
of (kv/miss_reasons.py) from the cache manager to /metrics and `kvserve bench`'s report."""

from __future__ import annotations

from dataclasses import replace

import pytest
from kv_requests import make_request
from test_host_tier import A, B, run

from kvserve.bench.kv_sim import Tiers, chat, scan
from kvserve.bench.report import _memory_lines, memory_summary
from kvserve.bench.scrape import parse_evicted_tiers, parse_metrics, to_sample
from kvserve.config import CacheConfig
from kvserve.errors import ParameterError
from kvserve.kv.admission import ReuseAdmission
from kvserve.kv.cache_manager import KVCacheManager
from kvserve.kv.disk_tier import DiskTier
from kvserve.kv.host_tier import HostTier
from kvserve.server.metrics import ServerMetrics
from kvserve.step import SchedulerStats

C = list(range(300, 316))
D = list(range(400, 416))


def test_a_key_is_admitted_once_seen_threshold_times_and_old_counts_are_forgotten():
    gate = ReuseAdmission(2, capacity=2)
    gate.see([b"a", b"b"])
    assert not gate.admits(b"a") and gate.num_refused == 1
    gate.see([b"a"])
    assert gate.admits(b"a") and gate.times_seen(b"a") == 2
    gate.see([b"c"])  # 3 keys counted, capacity 2: b (least recently seen) is forgotten
    assert gate.times_seen(b"b") == 0 and gate.times_seen(b"a") == 2
    everyone = ReuseAdmission(1)
    everyone.see([b"x"])
    assert everyone.admits(b"never seen") and everyone.times_seen(b"x") == 0  # no counting


def test_a_shared_system_prompt_survives_bursts_larger_than_device_and_host_with_threshold_2():
    """6 rounds of a request with a 4-block system prompt, then 3 one-off prompts of 6 blocks
    (18 blocks > 8 device + 8 host).  Threshold 1: the burst flushes the host too (the bursts
    are longer than ARC's ghost lists, so the prompt is never seen reused): 0 hits, 131 copies.
    Threshold 2: the full host takes only blocks seen twice: every later round hits, 8 copies."""
    tiers = Tiers(8, 8, block_size=4)
    sizes = dict(rounds=6, burst=3, system_blocks=4, one_off_blocks=6, own_tokens=5)
    every = scan(tiers, 1, **sizes)
    gated = scan(tiers, 2, **sizes)
    assert (every.hit_rate, every.num_offloaded) == (0.0, 131)
    assert every.miss_tiers == {"device": 0, "host": 80, "disk": 0}  # 4 rounds x 4 blocks x 4
    assert (gated.hit_rate, gated.num_offloaded) == (1.0, 8)
    assert scan(replace(tiers, eviction="lru"), 2, **sizes).hit_rate == 1.0


@pytest.mark.parametrize(
    ("host", "every", "gated"),
    [(8, 0.385, 0.404), (32, 0.614, 0.628), (96, 0.826, 0.826)],
)
def test_multi_turn_chat_is_no_worse_with_threshold_2(host, every, gated):
    """6 conversations x 4 turns over a 20-block device: a history is seen once before its
    next turn comes back, so a gate on every store would lose it; the gate applies only to
    a full tier, so with room for every history (96) nothing changes, and with less the
    host keeps the blocks that came back at least once (slightly more hits)."""
    sizes = dict(conversations=6, turns=4, system_tokens=16, user_tokens=8, answer_tokens=4)
    tiers = Tiers(20, host, block_size=4)
    assert round(chat(tiers, 1, **sizes).hit_rate, 3) == every
    assert round(chat(tiers, 2, **sizes).hit_rate, 3) == gated


def test_a_full_host_refuses_a_block_seen_once_but_free_slots_take_it():
    cm = KVCacheManager(4, block_size=4, num_host_blocks=2, store_threshold=2)
    run(cm, "a", A)
    run(cm, "b", B)  # a's 2 blocks, seen once, go to the 2 free slots
    assert cm.host is not None and cm.host.num_used_slots == 2
    assert cm.host.stats.num_offloaded_blocks == 2
    run(cm, "c", C)  # b's 4 blocks, seen once, may not displace them
    assert cm.host.stats.num_offloaded_blocks == 2 and cm.admission.num_refused == 4
    run(cm, "a2", A)  # a hit from the host
    assert cm.prefix_stats.host_hits == 8
    assert cm.prefix_stats.evicted_by_tier == {"device": 0, "host": 0, "disk": 0}


def test_a_full_disk_takes_a_host_drop_only_when_admitted():
    seen = {b"k1"}
    host = HostTier(1, "lru", DiskTier(1), admit=lambda key: key in seen)
    host.offload(7, b"k0")
    host.offload(3, b"k1")  # drops k0 into the disk's free room: written
    host.offload(4, b"k2")  # drops k1 into a full disk: admitted, k0's file goes
    host.offload(5, b"k3")  # drops k2: refused, the disk keeps k1
    assert host.disk is not None and list(host.disk._keys) == [b"k1"]
    assert host.disk.stats.num_written_blocks == 2


@pytest.mark.parametrize(
    ("tiers", "tier"),
    [
        ({}, "device"),
        ({"num_host_blocks": 1}, "host"),
        ({"num_host_blocks": 1, "num_disk_blocks": 2}, "disk"),
        ({"num_host_blocks": 1, "store_threshold": 2}, "device"),  # refused by a full host
    ],
)
def test_an_evicted_miss_names_the_lowest_tier_that_held_the_block(tiers, tier):
    """A's 2 full blocks are pushed out by B, C and D (4 blocks each): on a lone device
    they are gone from it; with a 1-slot host they pass through it; with a 2-block disk
    below, through that; with threshold 2 the full host never takes them."""
    cm = KVCacheManager(4, block_size=4, **tiers)
    for request_id, tokens in (("a", A), ("b", B), ("c", C), ("d", D)):
        run(cm, request_id, tokens)
    assert cm.find_cached_prefix(make_request(cm, "x", A)).num_tokens == 0
    run(cm, "a2", A)
    assert cm.prefix_stats.misses["evicted"] == 8
    assert cm.prefix_stats.evicted_by_tier == {"device": 0, "host": 0, "disk": 0, tier: 8}


def test_a_reset_counts_a_block_held_by_host_and_disk_as_fallen_out_of_disk():
    cm = KVCacheManager(4, block_size=4, num_host_blocks=1, num_disk_blocks=2)
    run(cm, "a", A)
    run(cm, "b", B)  # a's block 1 on disk, block 0 in the host
    cm.reset_prefix_cache()
    run(cm, "a2", A)
    assert cm.prefix_stats.evicted_by_tier == {"device": 0, "host": 4, "disk": 4}


def test_metrics_and_bench_split_the_evicted_misses_by_tier():
    misses = {"below_block_size": 3, "isolated": 0, "evicted": 40, "never_seen": 48}
    tiers = {"device": 8, "host": 12, "disk": 20}
    stats = SchedulerStats(1, 0, 0.5, 10, 0, 100, 17, 0.0, misses, tiers)
    text = ServerMetrics(lambda: stats, "m").exposition().decode()
    line = 'kvserve:prefix_cache_evicted_miss_tokens_total{model_name="m",tier="host"} 12.0'
    assert line in text
    assert 'prefix_cache_miss_tokens_total{model_name="m",reason="evicted"} 40.0' in text
    assert parse_evicted_tiers(text) == {k: float(v) for k, v in tiers.items()}
    first, last = to_sample(parse_metrics(text), 0.0), to_sample(parse_metrics(text), 1.0)
    last.prefix_cache_evicted_by_tier.update({**parse_evicted_tiers(text), "disk": 36.0})
    lines = _memory_lines(memory_summary([first, last]))
    assert any(line.split() == ["evicted", "from", "disk", "(tokens):", "36"] for line in lines)


def test_the_threshold_flag_must_be_at_least_1():
    with pytest.raises(ParameterError, match="--kv-offloading-store-threshold"):
        CacheConfig(kv_offloading_size=1.0, kv_offloading_store_threshold=0)
    assert CacheConfig().kv_offloading_store_threshold == 2
