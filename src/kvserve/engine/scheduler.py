"""Continuous batching: a token budget per step, chunked prefill, preemption, an admission
policy (fcfs, priority, lpm).

There are no prefill and decode phases.  Each request simply needs
``num_tokens - num_computed_tokens`` more tokens computed (a prompt many, a decode one, a
preempted request all of them again); each step hands out `max_num_batched_tokens`:

1. running requests, decodes first, then unfinished prefills (a chunk of what the budget
   allows).  When the cache manager has no block for one, the most recently admitted running
   request not yet scheduled this step (under the priority policy: the one with the highest
   (priority, arrival)) is preempted by recompute: its blocks are freed (full ones stay in
   the prefix cache), it goes back to the front of the waiting queue.
2. then waiting requests, in the order of --scheduling-policy (scheduling_policy.py;
   docs/decisions/scheduling-policy.md), while budget, `max_num_seqs` and blocks last (the
   first that does not fit stops admission, so none is overtaken for ever); each first takes
   its longest cached prefix for free.  Admission keeps a growth reserve
   free: a fraction of the blocks that the running requests (and the new one) may still
   need to reach prompt + max_tokens.  The fraction starts at 0 (admit while blocks last, as
   vLLM does), rises by GROWTH_RESERVE_STEP with every preemption and decays by
   GROWTH_RESERVE_DECAY per step, so a workload that keeps outgrowing the cache stops
   thrashing (admit, grow, preempt, recompute the prompt) and one whose requests end early
   keeps admitting freely.  On W1 (docs/decisions/growth-reserve.md: 128 x 256 + 128; a cache for
   30 of them) the first version preempted 39 times and recomputed about 9k prompt tokens.

Preemption with a host tier (--kv-offloading-size): the preempted request's full blocks stay
cached on the device; those the other requests then evict are copied to host memory
(kv/host_tier.py), and on resumption its prefix lookup loads them back, so it recomputes at
most its last partial block instead of everything.

With a disk tier below it (--kv-offloading-dir) a request whose prefix has blocks on disk
only is passed over while a reader thread brings them into host slots (the cache manager's
`fetch_disk_hits`); the others are admitted meanwhile, and it is admitted once the runner
has reported its reads (`finish_disk_reads`; a failed read is a miss, recomputed).

Parallel sampling: siblings of a request (``fork_of``) wait until its prompt is computed, then
share its prompt blocks by reference and recompute only the last prompt token (they need its
logits to sample their own first token); the shared partial block is copied on write.

Pure Python: the scheduler needs a SchedulerConfig and a KVCacheManager, nothing else.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

from kvserve.engine.request_queue import RequestQueue
from kvserve.engine.scheduling_policy import WaitingOrder, priority_key
from kvserve.engine.stopping import check_stop_token
from kvserve.errors import ParameterError
from kvserve.kv.cache_manager import NO_PREFIX, KVCacheManager
from kvserve.request import Request, RequestStatus
from kvserve.step import ScheduledRequest, SchedulerOutput, SchedulerStats, TierStats

GROWTH_RESERVE_STEP = 0.25  # added to the reserve fraction per preemption (capped at 1)
GROWTH_RESERVE_DECAY = 0.002  # removed per step: back to 0 after 500 steps without preemption


class Scheduler:
    def __init__(
        self,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        cache_manager: KVCacheManager,
        waiting_order: WaitingOrder | None = None,
    ) -> None:
        self.order = waiting_order or WaitingOrder()  # fcfs
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.cache_manager = cache_manager
        self.waiting = RequestQueue()  # O(1) abort of a waiting request
        self.running: list[Request] = []  # in admission order
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.growth_reserve = 0.0  # fraction of future growth kept free at admission
        self._finished_ids: list[str] = []
        self._pending_forks: dict[str, list[Request]] = {}  # source id -> siblings
        self._fetching: set[str] = set()  # waiting for their prefix's disk reads

    # ----------------------------------------------------------------- requests in and out
    def add_request(self, request: Request) -> None:
        """Queue a request; reject at once one that could never fit (ValueError)."""
        num_prompt = request.num_prompt_tokens
        if num_prompt == 0:
            raise ParameterError("prompt", "must contain at least one token")
        max_tokens = request.sampling_params.max_tokens or 1
        if num_prompt + max_tokens > self.max_model_len:
            raise ParameterError(
                "max_tokens",
                f"({max_tokens}) + prompt ({num_prompt} tokens) = {num_prompt + max_tokens} "
                f"exceeds max_model_len ({self.max_model_len})",
            )
        if request.priority and self.order.policy != "priority":
            raise ParameterError(
                "priority",
                f"is used only with --scheduling-policy priority (this server runs "
                f"{self.order.policy}); omit it or send 0, got {request.priority}",
            )
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        request.hash_blocks_with(self.cache_manager.block_hasher)  # reads its cache_salt
        self.requests[request.request_id] = request
        if request.fork_of in self.requests:
            self._pending_forks.setdefault(request.fork_of, []).append(request)
        else:
            self.waiting.append(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """End a request (stop string, abort, or a stop token); frees its blocks at once."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)  # at most max_num_seqs long
        elif not self.waiting.remove(request):
            self._pending_forks[request.fork_of].remove(request)  # at most n - 1 long
        # Siblings still waiting for this request's prompt compute it themselves.
        self.waiting.extend(self._pending_forks.pop(request_id, []))
        request.status = status
        self._fetching.discard(request_id)  # its disk reads go on: their blocks stay cached
        self.cache_manager.free(request_id, request.kv_retention_priority)
        self._finished_ids.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        """Sequences not yet running: queued, preempted, or siblings awaiting their fork."""
        return len(self.waiting) + sum(map(len, self._pending_forks.values()))

    # ----------------------------------------------------------------- one step
    def schedule(self) -> SchedulerOutput:
        self.growth_reserve = max(0.0, self.growth_reserve - GROWTH_RESERVE_DECAY)
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        done: set[str] = set()
        decodes_first = sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1)
        for request in decodes_first:
            if budget == 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            num_new = self.cache_manager.chunk_limit(request.num_computed_tokens, num_new)
            if not self._allocate_or_preempt(request, num_new, done, preempted):
                continue
            scheduled.append(self._scheduled(request, num_new))
            done.add(request.request_id)
            budget -= num_new
        if not preempted:
            budget = self._admit_waiting(budget, scheduled)
        return self._output(scheduled, preempted)

    def admissible_head(self, num: int) -> list[Request]:
        """The first `num` waiting requests when this step could admit one (a free sequence
        slot), else none: what the prefix store reads back blocks for before a step (blocks
        read for a request that cannot start could be evicted before it does)."""
        return self.waiting.first(num) if len(self.running) < self.max_num_seqs else []

    def tier_copies_only(self) -> SchedulerOutput:
        """A step that computes nothing: the tier copies queued since the last step (blocks
        the prefix store's reads evicted, copied to the host tier before they are reused)."""
        return self._output([], [])

    def _output(self, scheduled: list[ScheduledRequest], preempted: list[str]) -> SchedulerOutput:
        finished, self._finished_ids = self._finished_ids, []
        transfers = self.cache_manager.take_host_transfers()
        return SchedulerOutput(
            scheduled, preempted, finished, self.cache_manager.take_block_copies(),
            blocks_to_host=transfers.offloads, blocks_from_host=transfers.loads,
            host_to_disk=transfers.to_disk, device_to_disk=transfers.device_to_disk,
            disk_to_host=transfers.from_disk,
            disk_deletes=transfers.disk_deletes,
        )  # fmt: skip

    def _allocate_or_preempt(
        self, request: Request, num_new: int, done: set[str], preempted: list[str]
    ) -> bool:
        """Allocate blocks for `num_new` tokens, preempting newer requests until it fits.
        Returns False when `request` itself had to be preempted."""
        cm = self.cache_manager
        while cm.allocate_slots(request.request_id, request.num_computed_tokens, num_new) is None:
            victim = self._victim(request, done)
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _victim(self, request: Request, done: set[str]) -> Request:
        """The running request to preempt so that `request` fits: the newest not yet
        scheduled this step, or under the priority policy (vLLM's) the one with the highest
        (priority, arrival); `request` itself when no other is left."""
        if self.order.policy == "priority":
            others = [r for r in self.running if r.request_id not in done]
            return max(others, key=priority_key) if others else request
        return next((r for r in reversed(self.running) if r.request_id not in done), request)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.cache_manager.free(request.request_id, request.kv_retention_priority)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.growth_reserve = min(1.0, self.growth_reserve + GROWTH_RESERVE_STEP)
        self.waiting.appendleft(request)

    def _admit_waiting(self, budget: int, scheduled: list[ScheduledRequest]) -> int:
        """Admit waiting requests in the policy's order; a request leaves the queue only once
        admitted.  A request whose next uncached blocks are being
        computed in this very step by another request reads them from there and computes only
        what follows (many requests with one system prompt arrive together: the first computes
        the prompt, the others their own suffixes, all in the first step)."""
        cm = self.cache_manager
        in_flight = self._blocks_in_flight(scheduled)
        growth = sum(self._growth_blocks(r, cm.num_blocks_of(r.request_id)) for r in self.running)
        for request in self._candidates(self.max_num_seqs - len(self.running)):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            forked = cm.num_blocks_of(request.request_id) > 0  # holds its sibling's blocks
            cached = NO_PREFIX
            if not forked:
                fetched = cm.fetch_disk_hits(cm.find_cached_prefix(request))
                if fetched is None:  # its blocks are on their way from disk: others first
                    self._fetching.add(request.request_id)
                    continue
                self._fetching.discard(request.request_id)
                cached = cm.extend_with_in_flight(request, fetched, in_flight)
            num_computed = request.num_computed_tokens if forked else cached.num_tokens
            num_new = cm.chunk_limit(num_computed, min(request.num_tokens - num_computed, budget))
            own_growth = self._growth_blocks(request, cm.blocks_needed(num_computed + num_new))
            reserve = math.ceil(self.growth_reserve * (growth + own_growth)) if self.running else 0
            if (
                cm.allocate_slots(request.request_id, num_computed, num_new, cached, reserve)
                is None
            ):
                break
            self.waiting.remove(request)
            if not forked:
                cm.record_prefix_query(request, cached.num_tokens, cached.num_host_tokens,
                                       cached.num_disk_tokens)  # fmt: skip
                in_flight.update(cm.blocks_computed_in_step(request, num_computed, num_new))
            if request.num_cached_tokens < 0:  # first admission: what the cache supplied
                request.num_cached_tokens = 0 if forked else cached.num_tokens
            request.num_computed_tokens = num_computed
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
            growth += own_growth
        return budget

    def _candidates(self, num_slots: int) -> Iterator[Request]:
        """The policy's candidates for `num_slots`, then more while requests waiting for their
        disk reads are passed over (as many more as they are), each once."""
        tried: set[str] = set()
        while True:
            batch = [r for r in self.order.candidates(self.waiting, num_slots + len(self._fetching),
                                                      self._cached_tokens)
                     if r.request_id not in tried]  # fmt: skip
            if not batch:
                return
            for request in batch:
                tried.add(request.request_id)
                yield request

    def finish_disk_reads(self, done: Sequence[bytes], failed: Sequence[bytes]) -> None:
        """The runner's report of disk reads since the last one (ModelRunnerOutput): the
        requests waiting for them are admitted from the next step on (a failed read's blocks
        are computed)."""
        if done or failed:
            self.cache_manager.finish_disk_reads(done, failed)

    def _cached_tokens(self, request: Request) -> int:
        """Tokens a waiting request would not compute: its cached prefix (both tiers), or
        for a forked sibling the prompt blocks it already shares."""
        if self.cache_manager.num_blocks_of(request.request_id):
            return request.num_computed_tokens
        return self.cache_manager.find_cached_prefix(request).num_tokens

    def _growth_blocks(self, request: Request, num_blocks_held: int) -> int:
        """Blocks `request` may still need beyond `num_blocks_held` to reach its longest
        possible length (prompt + max_tokens, at most max_model_len)."""
        max_tokens = request.sampling_params.max_tokens
        longest = self.max_model_len
        if max_tokens is not None:
            longest = min(longest, request.num_prompt_tokens + max_tokens)
        return max(0, self.cache_manager.blocks_needed(longest) - num_blocks_held)

    def _blocks_in_flight(self, scheduled: list[ScheduledRequest]) -> dict[bytes, int]:
        """Key -> block id of the full blocks that this step's prefills complete (not yet in
        the cache)."""
        blocks: dict[bytes, int] = {}
        for item in scheduled:
            if item.num_tokens > 1:
                request = self.requests[item.request_id]
                blocks.update(
                    self.cache_manager.blocks_computed_in_step(
                        request, item.start_position, item.num_tokens
                    )
                )
        return blocks

    def _scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start : start + num_new],
            start_position=start,
            block_table=self.cache_manager.block_table(request.request_id),
            group_block_tables=self.cache_manager.group_block_tables(request.request_id),
            sample=start + num_new == request.num_tokens,
            sampling_params=request.sampling_params,
            num_output_tokens=request.num_output_tokens,
            eos_token_ids=request.eos_token_ids,
        )

    # ----------------------------------------------------------------- after the model ran
    def update_from_output(
        self,
        output: SchedulerOutput,
        sampled_token_ids: dict[str, int],
        grammar_stops: dict[str, RequestStatus] | None = None,
    ) -> list[Request]:
        """Advance computed counts, cache newly full blocks, append sampled tokens, finish
        requests that hit a stop condition.  Returns the requests that got a new token.
        `grammar_stops`: the sequences whose grammar ended with this token (structured/), with
        their status; it wins over the token rules (a complete grammar at max_tokens stops)."""
        updated = []
        cm = self.cache_manager
        for item in output.scheduled:
            request = self.requests.get(item.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # finished or aborted while the step ran
            request.num_computed_tokens += item.num_tokens
            cm.cache_full_blocks(request, request.num_computed_tokens)
            if request.num_computed_tokens >= request.num_prompt_tokens:
                self._fork_siblings(request)
            if not item.sample:
                continue
            request.append_output_token(sampled_token_ids[item.request_id])
            updated.append(request)
            status = grammar_stops.get(request.request_id) if grammar_stops else None
            if status is None:
                status = check_stop_token(request, self.max_model_len)
            if status is not None:
                self.finish_request(request.request_id, status)
        return updated

    def _fork_siblings(self, source: Request) -> None:
        """Siblings share source's prompt blocks and go to the front of the waiting queue."""
        siblings = self._pending_forks.pop(source.request_id, [])
        for sibling in reversed(siblings):
            self.cache_manager.fork(source.request_id, sibling.request_id, source.num_prompt_tokens)
            sibling.num_computed_tokens = sibling.num_prompt_tokens - 1
            self.waiting.appendleft(sibling)

    def stats(self) -> SchedulerStats:
        cm = self.cache_manager
        held = sum(cm.tokens_held(r.request_id, r.num_computed_tokens) for r in self.running)
        slots = sum(cm.num_blocks_of(r.request_id) for r in self.running) * cm.block_size
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=self.num_waiting,
            kv_cache_usage=cm.usage,
            num_free_blocks=cm.num_free_blocks,
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=cm.prefix_stats.queries,
            prefix_cache_hits=cm.prefix_stats.hits,
            prefix_cache_misses=dict(cm.prefix_stats.misses),
            prefix_cache_evicted_by_tier=dict(cm.prefix_stats.evicted_by_tier),
            kv_waste=1.0 - held / slots if slots else 0.0,
            prefix_cache_host_hits=cm.prefix_stats.host_hits,
            **_host_tier_stats(cm),
            tiers=_tier_stats(cm),
        )


def _host_tier_stats(cm: KVCacheManager) -> dict[str, int | float]:
    """The SchedulerStats fields of the host tier (their defaults without one)."""
    host = cm.host
    if host is None:
        return {}
    return dict(
        num_host_blocks=host.num_slots,
        host_kv_cache_usage=host.usage,
        num_offloaded_blocks=host.stats.num_offloaded_blocks,
        num_loaded_blocks=host.stats.num_loaded_blocks,
    )


def _tier_stats(cm: KVCacheManager) -> dict[str, TierStats]:
    """Each tier's blocks and traffic: device ("device"), host ("host", --kv-offloading-size)
    and disk ("disk", --kv-offloading-dir) where they exist.  A promotion copies a block up
    out of the tier (a hit there), a demotion copies one into it from the tier above."""
    hits = cm.prefix_stats
    pool = cm.pool
    tiers = {"device": TierStats(hits.hits - hits.host_hits, pool.num_holding_blocks,
                                 pool.num_blocks, 0, 0)}  # fmt: skip
    host = cm.host
    if host is None:
        return tiers
    tiers["host"] = TierStats(hits.host_hits - hits.disk_hits, host.num_used_slots,
                              host.num_slots, host.stats.num_loaded_blocks,
                              host.stats.num_offloaded_blocks)  # fmt: skip
    disk = host.disk
    if disk is not None:
        d = disk.stats
        tiers["disk"] = TierStats(
            hits.disk_hits, len(disk), disk.num_blocks, d.num_read_blocks, d.num_written_blocks,
            d.num_lost_blocks, d.num_found_blocks,
        )  # fmt: skip
    return tiers
