"""Plain data passed between scheduler, model runner and engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvserve.request import SamplingParams


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step: compute `token_ids` at positions start_position...

    `sample` is True when this step reaches the end of the request's known tokens, so the
    token sampled from the last position is kept (False for a non-final prefill chunk)."""

    request_id: str
    token_ids: list[int]
    start_position: int
    block_table: list[int]
    sample: bool
    sampling_params: SamplingParams
    num_output_tokens: int  # before this step; min_tokens needs it
    eos_token_ids: frozenset[int]
    # The block tables of KV cache groups 1.. (kv/groups.py; NULL_BLOCK = -1 where a window
    # freed a block); empty with one group.  `block_table` is group 0's.
    group_block_tables: tuple[list[int], ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]  # running decodes first, then prefills
    preempted_request_ids: list[str]
    finished_request_ids: list[str]  # finished since the previous step: runners drop state
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst), copy first
    # The host tier's copies, each (device block, host slot), made before block_copies:
    # first every offload (device -> host), then every load (host -> device).
    blocks_to_host: list[tuple[int, int]] = field(default_factory=list)
    blocks_from_host: list[tuple[int, int]] = field(default_factory=list)
    # The disk tier's (--kv-offloading-dir), before those: host slots written to files (host
    # slot, key), then reads of files into reserved host slots started (key, host slot: a
    # reader thread makes them; ModelRunnerOutput reports them done); after every copy, the
    # files of these keys are deleted.
    host_to_disk: list[tuple[int, bytes]] = field(default_factory=list)
    device_to_disk: list[tuple[int, bytes]] = field(default_factory=list)  # (block, key)
    disk_to_host: list[tuple[bytes, int]] = field(default_factory=list)
    disk_deletes: list[bytes] = field(default_factory=list)

    @property
    def has_tier_copies(self) -> bool:
        """Whether the step copies blocks between tiers (a failed step may have made only
        some of them)."""
        return bool(self.blocks_to_host or self.blocks_from_host)

    @property
    def has_disk_copies(self) -> bool:
        return bool(self.host_to_disk or self.device_to_disk or self.disk_to_host)

    # Constrained decoding (kvserve/structured/): row i of `grammar_bitmask`, a numpy int32
    # array [R, ceil(tokenizer vocab / 32)] whose bit t (word t // 32, bit t % 32) is set where
    # token t is allowed next, masks the logits of grammar_request_ids[i]; tokens past the
    # mask's width are disallowed.  None when no sampled row has a grammar.
    grammar_bitmask: Any = None
    grammar_request_ids: tuple[str, ...] = ()

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


@dataclass(frozen=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first


@dataclass(frozen=True)
class ModelRunnerOutput:
    sampled_token_ids: dict[str, int]  # only requests whose ScheduledRequest.sample is True
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    # The disk tier's reads that ended since the last output, on every rank
    # (executor/disk_reads.py): in their host slots, or failed on some rank (file gone or
    # corrupt: a miss).
    disk_reads_done: tuple[bytes, ...] = ()
    disk_reads_failed: tuple[bytes, ...] = ()


@dataclass(frozen=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # referenced blocks / all blocks
    num_free_blocks: int
    num_preemptions: int  # since start
    prefix_cache_queries: int  # since start, tokens
    prefix_cache_hits: int  # of both tiers
    kv_waste: float  # allocated slots of running requests not holding a computed token
    # since start, missed prompt tokens by reason (kv/miss_reasons.py): below_block_size,
    # isolated, evicted, never_seen
    prefix_cache_misses: dict[str, int] = field(default_factory=dict)
    # the `evicted` ones by the tier they last fell out of: device, host, disk
    prefix_cache_evicted_by_tier: dict[str, int] = field(default_factory=dict)
    # the host tier (--kv-offloading-size): hits served from it (tokens, part of
    # prefix_cache_hits), blocks copied each way, slots used / all (0 without a tier)
    prefix_cache_host_hits: int = 0
    num_host_blocks: int = 0
    host_kv_cache_usage: float = 0.0
    num_offloaded_blocks: int = 0
    num_loaded_blocks: int = 0
    # since start: errors that turned the --prefix-cache-dir store off (engine/prefix_store.py)
    prefix_store_errors: int = 0
    num_kv_events_dropped_batches: int = 0  # since start, KV event batches never sent
    tiers: dict[str, TierStats] = field(default_factory=dict)  # by tier: device, host, disk


@dataclass(frozen=True)
class TierStats:
    """One tier of the prefix cache (device, host or disk): prompt tokens it supplied since
    start, blocks it holds and can hold, blocks copied up out of it (promotions: its hits)
    and into it from the tier above (demotions)."""

    hit_tokens: int
    num_blocks: int
    capacity_blocks: int
    num_promoted_blocks: int
    num_demoted_blocks: int
    # the disk tier's shared folder: files gone or corrupt when read (recomputed), and files
    # another server wrote that a lookup found
    num_lost_blocks: int = 0
    num_found_blocks: int = 0


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """Cumulative state of one user request (all n samples) after a step."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0


def merge_deltas(deltas: list[RequestOutput]) -> RequestOutput:
    """One DELTA output holding what `deltas` (of one request, in order) hold together: the
    coalescing of a reader that fell behind, and the collection of a whole response.  O(total
    size): texts are joined once, not appended one by one."""
    if len(deltas) == 1:
        return deltas[0]
    last = deltas[-1]
    outputs = []
    for index, final in enumerate(last.outputs):
        parts = [d.outputs[index] for d in deltas]
        logprobs = None
        if final.logprobs is not None:
            logprobs = [lp for p in parts if p.logprobs is not None for lp in p.logprobs]
        outputs.append(
            CompletionOutput(
                index=final.index,
                text="".join(p.text for p in parts),
                token_ids=[t for p in parts for t in p.token_ids],
                finish_reason=final.finish_reason,
                stop_reason=final.stop_reason,
                logprobs=logprobs,
            )
        )
    return RequestOutput(
        request_id=last.request_id,
        prompt=last.prompt,
        prompt_token_ids=last.prompt_token_ids,
        outputs=outputs,
        finished=last.finished,
        num_cached_tokens=last.num_cached_tokens,
    )
