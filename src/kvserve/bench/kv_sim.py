"""Prefix-cache traces simulated over the cache manager alone (no model, no scheduler: one
request at a time, prefilled whole, its answer decoded, freed), for comparing tier settings
such as the store threshold (kv/admission.py): benchmarks/admission_sim.py prints them at
the issue's sizes, tests/unit/test_admission.py pins small ones.

* scan: a trickle of requests sharing a system prompt, each followed by a burst of one-off
  prompts; the shared prompt's hit rate (tokens found in any tier / its tokens, rounds 2+).
* chat: conversations sharing a system prompt, each turn resending its whole history (the
  earlier turns' prompts and answers), turns of all conversations interleaved round-robin;
  the mean cached fraction of turns 2+ prompts.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.kv.cache_manager import CachedPrefix, KVCacheManager
from kvserve.request import Request, SamplingParams


@dataclass(frozen=True)
class Tiers:
    """The simulated cache: blocks of each tier (disk 0: none)."""

    device: int
    host: int
    disk: int = 0
    block_size: int = 16
    eviction: str = "arc"

    def manager(self, threshold: int) -> KVCacheManager:
        return KVCacheManager(self.device, self.block_size, num_host_blocks=self.host,
                              num_disk_blocks=self.disk, eviction=self.eviction,
                              store_threshold=threshold)  # fmt: skip


@dataclass(frozen=True)
class Result:
    hit_rate: float  # scan: the shared prompt's; chat: turns 2+ prompts' mean cached fraction
    num_offloaded: int  # device -> host copies
    num_written: int  # host -> disk writes
    miss_tiers: dict[str, int]  # evicted misses (tokens) by the tier they fell out of


class Simulator:
    """Requests served one at a time over one cache manager."""

    def __init__(self, cm: KVCacheManager) -> None:
        self.cm = cm
        self._ids = itertools.count()

    def serve(self, prompt: Sequence[int], answer: Sequence[int] = ()) -> int:
        """Prefill `prompt` (its cached prefix found in any tier), decode `answer` (its blocks
        cached as they fill), free; returns the prompt tokens found cached."""
        cm = self.cm
        request = Request(f"r{next(self._ids)}", list(prompt), SamplingParams())
        request.hash_blocks_with(cm.block_hasher)
        cached = self._fetched(cm.find_cached_prefix(request))
        num_new = len(prompt) - cached.num_tokens + len(answer)
        assert cm.allocate_slots(request.request_id, cached.num_tokens, num_new, cached)
        cm.record_prefix_query(request, cached.num_tokens, cached.num_host_tokens,
                               cached.num_disk_tokens)  # fmt: skip
        for token in answer:
            request.append_output_token(token)
        cm.cache_full_blocks(request, len(request.all_token_ids))
        cm.free(request.request_id)
        cm.take_host_transfers()
        return cached.num_tokens

    def _fetched(self, cached: CachedPrefix) -> CachedPrefix:
        """The prefix once its disk-tier blocks are in host slots: the engine's reader thread
        reads them while the request waits; here every read lands at once."""
        cm = self.cm
        while (fetched := cm.fetch_disk_hits(cached)) is None:
            reads = cm.take_host_transfers().from_disk
            cm.finish_disk_reads([key for key, _ in reads], [])
        return fetched

    def result(self, hit_rate: float) -> Result:
        host = self.cm.host
        offloaded = host.stats.num_offloaded_blocks if host else 0
        written = host.disk.stats.num_written_blocks if host and host.disk else 0
        return Result(hit_rate, offloaded, written, dict(self.cm.prefix_stats.evicted_by_tier))


def scan(
    tiers: Tiers,
    threshold: int,
    rounds: int = 10,
    burst: int = 8,
    system_blocks: int = 32,
    one_off_blocks: int = 64,
    own_tokens: int = 40,
) -> Result:
    """`rounds` of: one request with the shared system prompt and `own_tokens` of its own,
    then `burst` one-off prompts of `one_off_blocks` full blocks and one token each."""
    bs = tiers.block_size
    sim = Simulator(tiers.manager(threshold))
    system = list(range(system_blocks * bs))
    fresh = itertools.count(1_000_000)
    hits = []
    for _ in range(rounds):
        hits.append(sim.serve(system + [next(fresh) for _ in range(own_tokens)]))
        for _ in range(burst):
            sim.serve([next(fresh) for _ in range(one_off_blocks * bs + 1)])
    later = hits[2:]  # round 0 computes it, round 1 is its first reuse
    return sim.result(sum(later) / (len(later) * len(system)))


def chat(
    tiers: Tiers,
    threshold: int,
    conversations: int = 64,
    turns: int = 6,
    system_tokens: int = 512,
    user_tokens: int = 96,
    answer_tokens: int = 48,
) -> Result:
    """Every conversation's turn 1, then every turn 2, ...: each prompt is the system prompt,
    the earlier turns' user messages and answers, and a new user message."""
    sim = Simulator(tiers.manager(threshold))
    fresh = itertools.count(1_000_000)
    histories = [list(range(system_tokens)) for _ in range(conversations)]
    fractions = []
    for turn in range(turns):
        for history in histories:
            history.extend(next(fresh) for _ in range(user_tokens))
            answer = [next(fresh) for _ in range(answer_tokens)]
            hit = sim.serve(history, answer)
            if turn:
                fractions.append(hit / len(history))
            history.extend(answer)
    return sim.result(sum(fractions) / len(fractions))
