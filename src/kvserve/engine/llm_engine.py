"""LLMEngine: the executor (every rank's model), the KV cache manager, the scheduler and the
output processor, stepped together.

    start-up: make_executor -> KV dtype check -> profile and size -> initialize the caches ->
              warm up -> cache manager, scheduler (vLLM's order; executor/abstract.py)
    add_request -> Scheduler.waiting (n children for n > 1: engine/output_processor.py)
    step():  schedule -> executor.execute -> update_from_output -> OutputProcessor
             (detokenize, stop strings) -> RequestOutput (one per user request touched)

With prefix caching, the children of an n > 1 request compute their shared prompt blocks once
and hold them by reference.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace

from torch.profiler import record_function

from kvserve.config import DEFAULT_RETENTION_PRIORITY, EngineConfig
from kvserve.engine.cache_services import PrefixCacheServices, disk_tier_dir, store_shape
from kvserve.engine.output_processor import OutputProcessor, make_children
from kvserve.engine.prefix_pins import PrefixPinning
from kvserve.engine.prefix_store import fingerprint
from kvserve.engine.scheduler import Scheduler
from kvserve.engine.scheduling_policy import WaitingOrder
from kvserve.engine.sizing import (
    KVCacheSizing,
    refuse_features_of_groups,
    resolve_max_model_len,
    size_disk_tier,
    size_host_tier,
    size_kv_cache,
)
from kvserve.errors import ParameterError
from kvserve.executor.abstract import Checkpoint
from kvserve.executor.base import ExecutorFailedError
from kvserve.executor.factory import make_executor
from kvserve.kv.spec import kv_cache_spec
from kvserve.request import RequestStatus, SamplingParams, check_priorities
from kvserve.step import RequestOutput, SchedulerOutput, SchedulerStats
from kvserve.structured.manager import StructuredOutputManager
from kvserve.tokenizer import load_tokenizer

logger = logging.getLogger("kvserve")


class StepFailedError(RuntimeError):
    """A step raised; the user requests it computed (`request_ids`) were aborted."""

    def __init__(self, request_ids: list[str], cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.request_ids = request_ids
        self.cause = cause


class EngineCorruptedError(RuntimeError):
    """An invariant of the engine's state is broken: serving must stop."""


class LLMEngine:
    def __init__(self, config: EngineConfig, checkpoint: Checkpoint | None = None) -> None:
        started = time.monotonic()
        self.executor = make_executor(config, checkpoint)  # every rank has built its model
        try:
            self._start(config)
        except BaseException:
            self.executor.shutdown()
            raise
        self._log_startup(time.monotonic() - started)

    # ----------------------------------------------------------------- start-up
    def _start(self, config: EngineConfig) -> None:
        ex = self.executor
        self.model_name, self.model_config = ex.model_name, ex.model_config
        # rank 0's CPU thread plan (native/platform.py): the thread that steps the engine, if
        # not this one, pins its own team to it (executor/base.py bind_compute_threads)
        self.cpu_threads = ex.cpu_threads
        self.tokenizer = load_tokenizer(ex.model_path)
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids) | (
            {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()
        )
        ex.calibrate_key_offsets(self.tokenizer)
        kv_dtype = ex.check_kv_cache_dtype(self.tokenizer)
        self.config = replace(config, cache=replace(config.cache, kv_cache_dtype=kv_dtype))
        sched = self.config.scheduler  # ValueError past the trained context, unless allowed
        self.max_model_len = resolve_max_model_len(
            sched.max_model_len, self.model_config.max_position_embeddings,
            sched.allow_long_max_model_len,
        )  # fmt: skip
        sizing = self.sizing = self._size_kv_cache()
        self.services = PrefixCacheServices(self.config.cache)  # a bad endpoint fails
        disk_dir = disk_tier_dir(self.config.cache, sizing, self._store_fingerprint())
        ex.initialize_kv_caches(
            sizing.spec, sizing.num_blocks, sizing.num_host_blocks, sizing.host_dtype,
            str(disk_dir) if disk_dir is not None else None,
        )  # fmt: skip
        ex.warm_up()  # writes into the first blocks: before the prefix store loads any
        self.cache_manager = self.services.make_cache_manager(sizing, self.tokenizer, ex, disk_dir)
        self.pins = PrefixPinning(self.cache_manager, self.config.cache.max_pinned_prefix_fraction,
                               sizing.spec.bytes_per_block)  # fmt: skip
        self.scheduler = Scheduler(
            sched.max_num_seqs, sched.max_num_batched_tokens, self.max_model_len,
            self.cache_manager,
            WaitingOrder(sched.scheduling_policy, sched.scheduling_max_wait_s),
        )  # fmt: skip
        self.output_processor = OutputProcessor(self.tokenizer, self.scheduler.finish_request)
        self.structured = StructuredOutputManager(self.tokenizer, self.eos_token_ids)
        self._open_prefix_store()

    def _size_kv_cache(self) -> KVCacheSizing:
        """Rank 0's bytes for the KV cache (profiled on every rank) -> whole blocks, and the
        host tier's."""
        cache, mc, ex = self.config.cache, self.model_config, self.executor
        spec = kv_cache_spec(
            mc.num_layers, mc.num_kv_heads, mc.head_dim, cache.kv_cache_dtype, ex.dtype_name,
            cache.block_size, self.config.load.tensor_parallel_size, mc.layer_windows(),
        )  # fmt: skip  # per rank: the largest rank's KV heads, rank 0's weights
        refuse_features_of_groups(spec, cache)
        budget = ex.determine_kv_budget_bytes(spec, self.max_model_len)
        sizing = size_kv_cache(spec, budget, self.max_model_len)
        if cache.kv_offloading_size is None:
            return sizing
        host = ex.measure_host_memory()
        sizing = size_host_tier(sizing, cache.kv_offloading_size, ex.device, host,
                                cache.kv_offloading_compression)  # fmt: skip
        return size_disk_tier(sizing, cache.kv_offloading_dir_size, cache.kv_offloading_dir)

    def _open_prefix_store(self) -> None:
        """Index the blocks of --prefix-cache-dir whose fingerprint matches (read lazily)."""
        if not self.config.cache.enable_prefix_caching:
            return
        print_ = self._store_fingerprint()
        self.services.open_store(
            print_,
            self.executor.kv_caches,
            self.cache_manager,
            lambda: self._run_scheduled(self.scheduler.tier_copies_only()),
        )

    def _store_fingerprint(self) -> dict[str, str]:
        """What stored K/V depend on: the prefix store's and the disk tier's folder name."""
        ex, mc, spec = self.executor, self.model_config, self.sizing.spec
        shape = store_shape(mc.num_layers, mc.num_kv_heads, mc.head_dim, spec)
        return fingerprint(ex.model_path, ex.dtype_name, spec.dtype, spec.block_size, shape,
                           self.tokenizer, ex.rotated_rows(spec.dtype))  # fmt: skip

    def _log_startup(self, seconds: float) -> None:
        mc, ex = self.model_config, self.executor
        logger.info(
            "model %s (%s, %d layers, %d heads / %d KV heads, head_dim %d) on %s in %s, "
            "attention %s, loaded in %.1fs",
            self.model_name, mc.architecture, mc.num_layers, mc.num_heads, mc.num_kv_heads,
            mc.head_dim, ex.device, ex.dtype_name, ex.attention_name, seconds,
        )  # fmt: skip
        logger.info(self.sizing.summary())

    # ----------------------------------------------------------------- requests
    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        kv_retention_priority: int = DEFAULT_RETENTION_PRIORITY,
    ) -> None:
        """Queue a request (n children for n > 1).  ValueError for one that can never fit.
        Its cached blocks are shared only with requests of the same `cache_salt` (and the
        public prefixes with every request); once freed they are evicted after those of a
        lower `kv_retention_priority` (0-100).  `priority` is vLLM's (lower first), used
        by --scheduling-policy priority (ParameterError under another policy unless 0)."""
        if request_id in self.output_processor:
            raise ValueError(f"request id {request_id!r} is already in use")
        vocab_size = self.model_config.vocab_size
        params.check_against(vocab_size, self.config.limits)
        check_priorities(priority, kv_retention_priority)
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ParameterError("prompt", f"token ids must be in [0, {vocab_size}), got {bad}")
        if params.structured is not None:  # compiled (cached by content: the server
            self.structured.compile(params.structured)  # compiled it on a tokenizer thread)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        children = make_children(request_id, token_ids, params, self.eos_token_ids, arrival,
                                 cache_salt, priority, kv_retention_priority)  # fmt: skip
        added = []
        try:
            for child in children:
                if params.structured is not None:  # a matcher per child: its own text
                    self.structured.add_request(child)
                self.scheduler.add_request(child)
                added.append(child.request_id)
        except ValueError:
            for child in children:
                self.structured.remove(child.request_id)
            for child_id in added:
                self.scheduler.finish_request(child_id, RequestStatus.FINISHED_ABORTED)
            raise
        self.output_processor.add_request(request_id, text, token_ids, children,
                                          params.output_kind)  # fmt: skip

    def abort_request(self, request_id: str) -> None:
        """Stop a user request now; its blocks are freed at once."""
        for child_id in self.output_processor.abort_request(request_id):
            self.scheduler.finish_request(child_id, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    @property
    def num_waiting_sequences(self) -> int:
        return self.scheduler.num_waiting

    def get_stats(self) -> SchedulerStats:
        dropped = self.services.num_dropped_event_batches
        return replace(
            self.scheduler.stats(),
            num_kv_events_dropped_batches=dropped,
            prefix_store_errors=self.services.num_store_errors,
        )

    def reset_prefix_cache(self, include_pinned: bool = False) -> int:
        """Drop every cached block no request holds (and the store on disk); how many.
        Pinned prefixes stay unless `include_pinned` (which unpins them first)."""
        num_dropped = self.services.reset(self.cache_manager, include_pinned)
        logger.info("prefix cache reset: %d cached blocks dropped", num_dropped)
        return num_dropped

    def close(self) -> None:
        """Write the prefix cache store, stop the KV event publisher and the tensor-parallel
        ranks (idempotent)."""
        self.services.close(self.cache_manager)
        self.executor.shutdown()

    def on_executor_failure(self, callback: Callable[[BaseException], None]) -> None:
        """`callback(error)` when a tensor-parallel rank dies, from another thread, even while
        no step runs (never with one rank)."""
        self.executor.set_failure_callback(callback)

    # ----------------------------------------------------------------- one step
    def step(self) -> list[RequestOutput]:
        """One step.  When anything after scheduling raises (the model, the sampler, the
        detokenizer), only the user requests of this step are aborted (blocks freed) and
        StepFailedError names them; the engine can go on.  EngineCorruptedError when the
        block bookkeeping no longer adds up afterwards: the engine must not go on."""
        with record_function("kvserve::schedule"):
            self.services.before_schedule(self.scheduler.admissible_head(4), self.cache_manager)
            scheduler_output = self.scheduler.schedule()
        try:
            outputs = self._run_scheduled(scheduler_output)
        except ExecutorFailedError:
            raise  # the ranks disagree from now on: no step can run
        except Exception as exc:
            failed = self._abort_step(scheduler_output)
            if scheduler_output.has_tier_copies:
                # The host tier's copies may not have run: forget what every tier caches
                # (disk reads under way are reported by a later step all the same).
                self.cache_manager.reset_prefix_cache()
            try:
                self.cache_manager.check_invariants()
            except AssertionError as broken:
                raise EngineCorruptedError(f"block bookkeeping broken: {broken}") from exc
            raise StepFailedError(failed, exc) from exc
        self.services.after_step(self.cache_manager)
        return outputs

    def _abort_step(self, scheduler_output: SchedulerOutput) -> list[str]:
        """Abort every user request with a sequence in `scheduler_output`; their ids."""
        failed = self.output_processor.user_ids_of(
            item.request_id for item in scheduler_output.scheduled
        )
        for user_id in failed:
            self.abort_request(user_id)
        return failed

    def _run_scheduled(self, scheduler_output: SchedulerOutput) -> list[RequestOutput]:
        """Model, then bookkeeping and detokenization (each a profiler range, named for the
        breakdown in benchmarks/side_by_side.py; free when no profiler runs)."""
        with record_function("kvserve::grammar_bitmask"):  # unchanged without a grammar
            scheduler_output = self.structured.with_bitmask(scheduler_output)
        with record_function("kvserve::model"):
            runner_output = self.executor.execute(scheduler_output)
        self.scheduler.finish_disk_reads(runner_output.disk_reads_done,
                                         runner_output.disk_reads_failed)  # fmt: skip
        with record_function("kvserve::update_detokenize"):
            sampled = runner_output.sampled_token_ids
            grammar_stops = self.structured.advance(scheduler_output, sampled)  # {}: none
            updated = self.scheduler.update_from_output(scheduler_output, sampled, grammar_stops)
            return self.output_processor.process_outputs(updated, runner_output.logprobs)
