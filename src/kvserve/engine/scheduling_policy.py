"""--scheduling-policy: which waiting requests the scheduler tries to admit, in which order.

    fcfs      arrival order (a preempted request goes back to the front).
    priority  vLLM's: the request field `priority`, lower first, ties by arrival.  Under
              memory pressure the running request with the highest (priority, arrival) is
              the one preempted (Scheduler._victim).
    lpm       longest cached prefix first (SGLang's "longest prefix match"), counting the
              device and the host tier: requests that share a prefix run while it is cached,
              instead of evicting it for a request whose prefix nobody else needs now, and
              being recomputed later.  Ties keep arrival order, so a queue with nothing
              cached is served as fcfs would.  Aging: a request that has waited
              `max_wait_s` goes before every one that has not (oldest first), so none
              starves behind a stream of better-cached ones.

Cost per step: fcfs reads the first `num_slots` requests; priority one pass over the queue
(heapq.nsmallest); lpm looks up the cached prefix of the first LPM_WINDOW requests only (one
dict lookup per cached block, stopping at the first miss), the rest wait in arrival order.

Duplicate prefills of one uncached prefix need no rule here: requests admitted in one step
read the blocks another computes in that step (KVCacheManager.extend_with_in_flight), and a
running prefill is given all it needs (or the whole budget) before anything is admitted, so a
request admitted later finds the prefix cached or in flight (test_scheduling_policy.py).
Why fcfs is the default, and the measurement: docs/decisions/scheduling-policy.md.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvserve.engine.request_queue import RequestQueue
from kvserve.request import Request

LPM_WINDOW = 128  # waiting requests ranked by cached prefix per step (SGLang stops at 128 too)


@dataclass(frozen=True)
class WaitingOrder:
    """The admission order of one policy; `clock` returns seconds on Request.arrival_time's
    clock (time.monotonic), replaced by tests to check the aging bound exactly."""

    policy: str = "fcfs"
    max_wait_s: float = 10.0
    clock: Callable[[], float] = field(default=time.monotonic, compare=False)

    def candidates(
        self, waiting: RequestQueue, num_slots: int, cached_tokens: Callable[[Request], int]
    ) -> list[Request]:
        """The waiting requests to try, best first (at least the first `num_slots` that the
        policy would admit).  Reads `waiting` and changes nothing; `cached_tokens(request)`
        is its cached prefix in tokens (called by lpm only)."""
        if num_slots <= 0 or not waiting:
            return []
        if self.policy == "priority":
            return heapq.nsmallest(num_slots, waiting, key=priority_key)
        if self.policy == "lpm":
            return self._longest_prefix_first(waiting.first(max(num_slots, LPM_WINDOW)),
                                              cached_tokens)  # fmt: skip
        return waiting.first(num_slots)

    def _longest_prefix_first(
        self, window: list[Request], cached_tokens: Callable[[Request], int]
    ) -> list[Request]:
        """Aged requests (waited >= max_wait_s) by arrival, then the others by cached prefix,
        longest first; sorted() is stable, so ties keep queue order."""
        now = self.clock()
        aged = [r for r in window if now - r.arrival_time >= self.max_wait_s]
        if len(aged) == len(window):
            return sorted(aged, key=lambda r: r.arrival_time)
        aged_ids = {r.request_id for r in aged}
        fresh = [r for r in window if r.request_id not in aged_ids]
        fresh.sort(key=lambda r: -cached_tokens(r))
        return sorted(aged, key=lambda r: r.arrival_time) + fresh


def priority_key(request: Request) -> tuple[int, float]:
    """vLLM's order: lower priority value first, then earlier arrival."""
    return request.priority, request.arrival_time
