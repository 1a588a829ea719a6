"""ModelRunner: SchedulerOutput -> BatchInput tensors -> model -> logits -> sampler.

The runner owns every tensor: the KV caches, the batch tensors and per-request generators.
It reads the scheduler output and never decides who runs.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch.profiler import record_function

from kvserve.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    DecodeStepPlan,
    PrefillSpan,
)
from kvserve.attention.kv_cache import LayerKVCache, distinct_caches
from kvserve.kv.spec import cdiv
from kvserve.request import SamplingParams
from kvserve.runner.cuda_graphs import DecodeGraphs, GraphPlan, describe
from kvserve.runner.disk_tier import DiskBlocks
from kvserve.runner.host_transfers import apply_host_transfers
from kvserve.runner.sampling import SamplingBatch, apply_token_bitmask, sample
from kvserve.step import (
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    TokenLogprobs,
)

logger = logging.getLogger("kvserve")

# The warm-up's steps: one token (specialized by torch.compile), whole rows, and rows with
# padding (ModelRunner.warm_up).
SMALL_STEPS_WARM_UP = (1, 16, 17)


@dataclass(frozen=True)
class BatchInput:
    """Flat tensors of one step (decodes first)."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    query_start_loc: torch.Tensor  # [B + 1]
    seq_lens: torch.Tensor  # [B] context length after this step
    block_tables: torch.Tensor  # [B, max_blocks], padded with 0
    slot_mapping: torch.Tensor  # [T] block_id * block_size + offset
    logits_indices: torch.Tensor  # [S] last token of each request that samples
    num_decodes: int
    shared_prefix_blocks: int  # see shared_prefix_blocks()


def build_batch_input(
    requests: list[ScheduledRequest], block_size: int, device: torch.device, group: int = 0
) -> BatchInput:
    """Vectorized construction: no Python loop over tokens.  `group`: the KV cache group whose
    block tables the batch carries (kv/groups.py; a request without tables of its own for
    the other groups, the warm-up's, uses group 0's in every group)."""
    num_tokens = [r.num_tokens for r in requests]
    starts = torch.tensor([r.start_position for r in requests], dtype=torch.long)
    counts = torch.tensor(num_tokens, dtype=torch.long)
    query_start_loc = torch.zeros(len(requests) + 1, dtype=torch.long)
    query_start_loc[1:] = counts.cumsum(0)
    total = int(query_start_loc[-1])
    row_of_token = torch.repeat_interleave(torch.arange(len(requests)), counts)
    positions = starts[row_of_token] + torch.arange(total) - query_start_loc[:-1][row_of_token]
    tables = [_group_table(r, group) for r in requests]
    max_blocks = max(len(t) for t in tables)
    # One tensor from padded lists: a copy into each row cost ~8 us a request (~1 ms of a
    # 128-row decode step).  A window group's freed blocks (-1) read as block 0: never read.
    block_tables = torch.tensor(
        [[*t, *itertools.repeat(0, max_blocks - len(t))] for t in tables], dtype=torch.long
    ).clamp_(min=0)
    slots = (
        block_tables[row_of_token, positions // block_size] * block_size + positions % block_size
    )
    sampling_rows = [i for i, r in enumerate(requests) if r.sample]
    logits_indices = query_start_loc[1:][sampling_rows] - 1
    input_ids = list(itertools.chain.from_iterable(r.token_ids for r in requests))
    return BatchInput(
        input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
        positions=positions.to(device),
        query_start_loc=query_start_loc.to(device),
        seq_lens=(starts + counts).to(device),
        block_tables=block_tables.to(device),
        slot_mapping=slots.to(device),
        logits_indices=logits_indices.to(device),
        num_decodes=sum(1 for n in num_tokens if n == 1),
        shared_prefix_blocks=shared_prefix_blocks(requests, block_tables, block_size),
    )


def _group_table(request: ScheduledRequest, group: int) -> list[int]:
    if group == 0 or not request.group_block_tables:
        return request.block_table
    return request.group_block_tables[group - 1]


def build_attention_metadata(batch: BatchInput, block_size: int) -> AttentionMetadata:
    """Split the batch into the decode group and per-request prefill spans."""
    d = batch.num_decodes
    starts = batch.query_start_loc.tolist()
    seq_lens = batch.seq_lens.tolist()
    prefills = []
    for row in range(d, len(seq_lens)):
        num_blocks = cdiv(seq_lens[row], block_size)
        table = batch.block_tables[row, :num_blocks]
        prefills.append(PrefillSpan(starts[row], starts[row + 1], seq_lens[row], table))
    return AttentionMetadata(
        slot_mapping=batch.slot_mapping,
        num_decode_tokens=d,
        decode_block_tables=batch.block_tables[:d],
        decode_seq_lens=batch.seq_lens[:d],
        prefills=tuple(prefills),
        shared_prefix_blocks=batch.shared_prefix_blocks,
    )


def shared_prefix_blocks(
    requests: list[ScheduledRequest], block_tables: torch.Tensor, block_size: int
) -> int:
    """Leading block ids common to every sequence of the step (block_tables: [B, max_blocks],
    on the CPU, before the batch moves to its device) that a backend may attend once for the
    sequences whose query tokens all come after them (see AttentionMetadata).

    All the common blocks when only prefill chunks start inside them: the request that
    computes a shared prompt in this step while the others read it (W3's first step, with
    same-step prefix sharing) keeps its own path, and the others still share the prefix.
    Otherwise only the blocks wholly before every sequence's first query token."""
    if len(requests) < 2:
        return 0
    common = int((block_tables == block_tables[:1]).all(0).int().cumprod(0).sum())
    inside = [r for r in requests if r.start_position < common * block_size]
    if len(inside) < len(requests) - 1 and all(r.num_tokens > 1 for r in inside):
        return common
    min_context = min(r.start_position for r in requests)
    return min(common, min_context // block_size)


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[LayerKVCache],
        backend: AttentionBackend,
        block_size: int,
        device: torch.device,
        seed: int = 0,
        host_kv_caches: list[LayerKVCache] | None = None,
        layer_groups: Sequence[int] = (),
        disk_blocks: DiskBlocks | None = None,
    ) -> None:
        """`host_kv_caches`: the host tier's per-layer caches (--kv-offloading-size);
        `layer_groups`: each layer's KV cache group where there are several (kv/spec.py);
        `disk_blocks`: the disk tier's files below the host tier (--kv-offloading-dir)."""
        self.model = model
        self.kv_caches = kv_caches
        self.host_kv_caches = host_kv_caches
        self.disk_blocks = disk_blocks
        self.layer_groups = tuple(layer_groups) if len(set(layer_groups)) > 1 else ()
        self.backend = backend
        self.block_size = block_size
        self.device = device
        self.vocab_size = model.config.vocab_size
        self._shared_generator = torch.Generator(device=device).manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}
        self.cuda_graphs: DecodeGraphs | None = None

    def capture_cuda_graphs(self, plan: GraphPlan, pad_block_id: int) -> None:
        """Run decode steps through CUDA graphs from now on (runner/cuda_graphs.py); block
        `pad_block_id` of the caches must be no part of the block pool.  On a CPU the same
        padding runs eagerly (tests).  A capture that fails leaves the runner eager, with a
        warning, never a failed start."""
        graphs = DecodeGraphs(
            self.model, self.kv_caches, self.backend, self.block_size, plan, pad_block_id
        )
        try:
            seconds = graphs.capture(record=self.device.type == "cuda")
        except Exception as exc:  # noqa: BLE001 - any capture failure: decode eagerly
            first_line = str(exc).splitlines()[0] if str(exc) else ""
            logger.warning(
                "CUDA graph capture failed, decoding eagerly (%s: %s)",
                type(exc).__name__, first_line,
            )  # fmt: skip
            return
        self.cuda_graphs = graphs
        logger.info(
            "captured %d CUDA graphs for decode in %.1fs (pool %.1f MiB): %s",
            len(plan.keys), seconds, graphs.pool_bytes / 2**20, describe(plan),
        )  # fmt: skip

    def warm_up(self, token_counts: Sequence[int] = SMALL_STEPS_WARM_UP) -> None:
        """Run a prefill of each of these token counts, so that torch.compile compiles (or
        loads from its cache) the graphs it needs now, at start-up, instead of in a user's
        request: dynamic shapes cover every batch size, but a single token is specialized, and
        a step whose token count is not the padded row count (17 tokens on 32 rows) takes
        another branch.  Without the 17, W3's second step (963 tokens on 1,024 rows) compiled
        two graphs: ~0.55 s of a 1.3 s step."""
        num_blocks = self.kv_caches[0].key.shape[0]
        for num_tokens in token_counts:
            if cdiv(num_tokens, self.block_size) <= num_blocks:
                self._execute(SchedulerOutput([dummy_request(num_tokens, self.block_size)], [], []))
        self._generators.clear()

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        """One step; the output also reports the disk tier's reads that ended meanwhile
        (taken last: a step that fails leaves them to the next one).  A step with nothing
        to compute waits a little for one, rather than spin."""
        result = self._execute(output)
        if self.disk_blocks is None:
            return result
        done, failed = self.disk_blocks.take_finished_reads(0.0 if output.scheduled else 0.005)
        if not done and not failed:
            return result
        return replace(result, disk_reads_done=tuple(done), disk_reads_failed=tuple(failed))

    @torch.inference_mode()
    def _execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in output.finished_request_ids:
            self._generators.pop(request_id, None)
        self._move_between_tiers(output)
        if output.block_copies:
            src, dst = torch.tensor(output.block_copies, device=self.device).unbind(1)
            for cache in distinct_caches(self.kv_caches):
                cache.copy_blocks(src, dst)
        if not output.scheduled:
            return ModelRunnerOutput({})
        # Decodes first: the attention backend batches them in one call.
        requests = sorted(output.scheduled, key=lambda r: r.num_tokens > 1)
        batch = build_batch_input(requests, self.block_size, self.device)
        hidden = self._run_graph(batch)
        if hidden is None and self.layer_groups:
            hidden = self._run_groups(requests, batch)
        elif hidden is None:
            metadata = build_attention_metadata(batch, self.block_size)
            hidden = self.model(
                batch.input_ids, batch.positions, self.kv_caches, metadata, self.backend,
                decode_plan=self._decode_plan(metadata),
            )  # fmt: skip
        sampling = [r for r in requests if r.sample]
        if not sampling:
            return ModelRunnerOutput({})
        logits = self.model.compute_logits(hidden[batch.logits_indices], upcast=False)
        constrained = self._apply_grammar_bitmask(logits, sampling, output)
        with record_function("kvserve::sample"):
            batch_params = self._sampling_batch(sampling, constrained)
            result = sample(logits, batch_params, self._shared_generator)
        token_ids = result.token_ids.tolist()
        sampled = {r.request_id: t for r, t in zip(sampling, token_ids, strict=True)}
        logprobs = self._logprobs(sampling, token_ids, result.logprobs)
        return ModelRunnerOutput(sampled, logprobs)

    def _move_between_tiers(self, output: SchedulerOutput) -> None:
        """The tiers' copies, in the order kv/host_tier.py queued them: host slots to disk,
        disk to host slots, then the host tier's offloads and loads; deletions last."""
        disk = self.disk_blocks
        if disk is None and output.has_disk_copies:
            raise RuntimeError("the scheduler asked for disk-tier copies but there is no tier")
        try:
            if disk is not None and output.host_to_disk:
                disk.write(output.host_to_disk)
            if disk is not None and output.device_to_disk:
                disk.write_from_device(self.kv_caches, output.device_to_disk)
        finally:  # every read asked for is started, so that each is reported once
            if disk is not None and output.disk_to_host:
                disk.start_reads(output.disk_to_host)
        if disk is not None and output.blocks_from_host:
            disk.wait_for_slots([slot for _, slot in output.blocks_from_host])
        apply_host_transfers(
            self.kv_caches, self.host_kv_caches, output.blocks_to_host, output.blocks_from_host
        )
        if disk is not None and output.disk_deletes:
            disk.delete(output.disk_deletes)

    def _run_groups(self, requests: list[ScheduledRequest], batch: BatchInput) -> torch.Tensor:
        """A step of a model whose layers form several KV cache groups: each group's metadata
        from its own block tables (its own slots), each layer given its group's."""
        group_metadata = [build_attention_metadata(batch, self.block_size)]
        for group in range(1, max(self.layer_groups) + 1):
            group_batch = build_batch_input(requests, self.block_size, self.device, group)
            group_metadata.append(build_attention_metadata(group_batch, self.block_size))
        layer_metadata = [group_metadata[group] for group in self.layer_groups]
        return self.model(
            batch.input_ids,
            batch.positions,
            self.kv_caches,
            group_metadata[0],
            self.backend,
            layer_metadata=layer_metadata,
        )

    def _decode_plan(self, metadata: AttentionMetadata) -> DecodeStepPlan | None:
        """A decode-only step's attention as data, where the model runs such a step's layers
        in one native call and the backend can plan it (attention/base.py); else None."""
        if metadata.prefills or not self.model.wants_decode_plan(metadata.num_decode_tokens):
            return None
        config = self.model.config
        return self.backend.plan_decode_step(
            self.kv_caches, metadata, self.model.dtype, config.num_heads
        )

    def _run_graph(self, batch: BatchInput) -> torch.Tensor | None:
        """Hidden states of a decode-only step through its CUDA graph; None: run eagerly."""
        if (
            self.cuda_graphs is None
            or self.layer_groups
            or batch.num_decodes != batch.input_ids.shape[0]
        ):
            return None
        return self.cuda_graphs.run(
            batch.input_ids, batch.positions, batch.slot_mapping, batch.seq_lens,
            batch.block_tables,
        )  # fmt: skip

    def _apply_grammar_bitmask(
        self, logits: torch.Tensor, sampling: list[ScheduledRequest], output: SchedulerOutput
    ) -> frozenset[str]:
        """Mask the constrained rows' logits to what their grammars allow (structured/), in
        one operation over those rows only; the ids of the rows masked."""
        if output.grammar_bitmask is None:
            return frozenset()
        row_of = {r.request_id: row for row, r in enumerate(sampling)}
        pairs = [
            (row_of[rid], i) for i, rid in enumerate(output.grammar_request_ids) if rid in row_of
        ]
        if not pairs:
            return frozenset()
        rows, mask_rows = zip(*pairs, strict=True)
        with record_function("kvserve::grammar_mask"):
            apply_token_bitmask(logits, list(rows), output.grammar_bitmask[list(mask_rows)])
        return frozenset(output.grammar_request_ids)

    def _sampling_batch(
        self, requests: list[ScheduledRequest], constrained: frozenset[str] = frozenset()
    ) -> SamplingBatch:
        """The step's sampling tensors.  A row whose grammar masks it keeps its EOS: min_tokens
        would ban what the grammar may allow alone, leaving no token."""
        generators = [self._generator(r) for r in requests]
        banned = []
        for row, r in enumerate(requests):
            params = r.sampling_params
            if r.num_output_tokens < params.min_tokens and r.request_id not in constrained:
                stop_ids = params.stop_token_id_set
                if not params.ignore_eos:
                    stop_ids = stop_ids | r.eos_token_ids
                if stop_ids:
                    banned.append((row, sorted(stop_ids)))
        params = [r.sampling_params for r in requests]
        return SamplingBatch.build(params, generators, banned, self.vocab_size, self.device)

    def _generator(self, request: ScheduledRequest) -> torch.Generator | None:
        seed = request.sampling_params.seed
        if seed is None or request.sampling_params.greedy:
            return None
        gen = self._generators.get(request.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(seed)
            self._generators[request.request_id] = gen
        return gen

    @staticmethod
    def _logprobs(
        requests: list[ScheduledRequest], token_ids: list[int], logprobs: torch.Tensor | None
    ) -> dict[str, TokenLogprobs]:
        if logprobs is None:
            return {}
        out = {}
        for row, (r, token_id) in enumerate(zip(requests, token_ids, strict=True)):
            k = r.sampling_params.logprobs
            if k is None:
                continue
            top_pairs: list[tuple[int, float]] = []
            if k:
                top = logprobs[row].topk(k)
                top_pairs = list(zip(top.indices.tolist(), top.values.tolist(), strict=True))
            out[r.request_id] = TokenLogprobs(token_id, float(logprobs[row, token_id]), top_pairs)
        return out


def dummy_request(num_tokens: int, block_size: int) -> ScheduledRequest:
    """A prefill of `num_tokens` zeros in blocks 0..n-1, for warm-up and profiling passes.
    It writes into those blocks' slots, which is harmless: a block's slots are always written
    by its owner before they are read, and these blocks hold no cached prefix."""
    return ScheduledRequest(
        request_id="warm-up",
        token_ids=[0] * num_tokens,
        start_position=0,
        block_table=list(range(cdiv(num_tokens, block_size))),
        sample=True,
        sampling_params=SamplingParams(temperature=0.0),
        num_output_tokens=0,
        eos_token_ids=frozenset(),
    )


def profile_peak_activation_bytes(
    model: torch.nn.Module,
    spec,  # KVCacheSpec
    num_tokens: int,
    backend: AttentionBackend,
    device: torch.device,
) -> int:
    """Peak CUDA memory of one forward over `num_tokens` prompt tokens (one sequence), beyond
    what was allocated before; used to size the KV cache on a GPU."""
    from kvserve.attention.kv_cache import allocate_kv_caches

    caches = allocate_kv_caches(spec, spec.num_blocks_for_tokens(num_tokens), device)
    dummy = dummy_request(num_tokens, spec.block_size)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    runner = ModelRunner(model, caches, backend, spec.block_size, device)
    runner.execute(SchedulerOutput([dummy], [], []))
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del caches, runner
    torch.cuda.empty_cache()
    return max(0, peak)
