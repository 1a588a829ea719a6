"""LLMEngine: ties scheduler, model runner, sampler and detokenizer into steps.

    add_request -> Scheduler.waiting
    step():  schedule -> ModelRunner.execute -> update_from_output -> detokenize, stop
             strings -> RequestOutput (one per user request touched; cumulative, a delta or only
             the final one, as the request's output_kind asks)

A user request with n > 1 becomes n child sequences ("<id>-<i>"); with prefix caching their
shared prompt blocks are computed once and held by reference.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch.profiler import record_function

if TYPE_CHECKING:
    from kvserve.executor.tensor_parallel import TensorParallelExecutor

from kvserve.attention import select_backend
from kvserve.attention.kv_cache import allocate_kv_caches
from kvserve.config import EngineConfig
from kvserve.engine.cache_services import PrefixCacheServices
from kvserve.engine.kv_dtype_check import Canary, check_kv_cache_dtype
from kvserve.engine.prefix_store import fingerprint
from kvserve.engine.public_prefixes import public_prefix_token_ids
from kvserve.engine.scheduler import Scheduler
from kvserve.engine.sizing import (
    KVCacheSizing,
    kv_budget_bytes,
    measure_host_memory,
    resolve_max_model_len,
    size_host_tier,
    size_kv_cache,
)
from kvserve.engine.stopping import StopStrings
from kvserve.errors import ParameterError
from kvserve.executor.base import ExecutorFailedError
from kvserve.kv.cache_manager import KVCacheManager
from kvserve.kv.spec import kv_cache_spec
from kvserve.models.llama import EAGER
from kvserve.models.loader import Checkpoint, load_checkpoint
from kvserve.models.registry import get_model_class
from kvserve.native import platform
from kvserve.request import Request, RequestOutputKind, RequestStatus, SamplingParams
from kvserve.runner.cuda_graphs import GraphPlan, decode_graph_plan, profile_graph_pool_bytes
from kvserve.runner.model_runner import ModelRunner, profile_peak_activation_bytes
from kvserve.step import (
    CompletionOutput,
    RequestOutput,
    SchedulerOutput,
    SchedulerStats,
    TokenLogprobs,
)
from kvserve.tokenizer import IncrementalDetokenizer, load_tokenizer

logger = logging.getLogger("kvserve")
CPU = torch.device("cpu")


class StepFailedError(RuntimeError):
    """A step raised; the user requests it computed (`request_ids`) were aborted."""

    def __init__(self, request_ids: list[str], cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.request_ids = request_ids
        self.cause = cause


class EngineCorruptedError(RuntimeError):
    """An invariant of the engine's state is broken: serving must stop."""


@dataclass
class _Sequence:
    """Engine-side state of one child sequence: its text, stop strings and logprobs, and how
    much of them earlier DELTA outputs already carried."""

    detokenizer: IncrementalDetokenizer
    stop_strings: StopStrings
    logprobs: list[TokenLogprobs] | None
    stopped_by: str | None = None  # the stop string that ended the text
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent_tokens: int = 0
    num_sent_chars: int = 0

    def completion(self, index: int, kind: RequestOutputKind) -> CompletionOutput:
        """This sequence's output: everything (CUMULATIVE, FINAL_ONLY; copies, O(output)), or
        what is new since the previous call (DELTA; O(new)).  Visible text only grows (held
        back text is never shown early), so a delta is a suffix."""
        finished = self.finish_reason is not None
        token_ids = self.detokenizer.token_ids
        text = self.stop_strings.visible(self.detokenizer.text, finished)
        num_tokens, num_chars = len(token_ids), len(text)
        first_token, first_char = 0, 0
        if kind is RequestOutputKind.DELTA:
            first_token, first_char = self.num_sent_tokens, self.num_sent_chars
            self.num_sent_tokens, self.num_sent_chars = num_tokens, num_chars
        logprobs = self.logprobs
        if logprobs is not None:
            logprobs = logprobs[first_token:num_tokens]
        return CompletionOutput(
            index=index,
            text=text[first_char:],
            token_ids=token_ids[first_token:num_tokens],
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=logprobs,
        )


@dataclass
class _UserRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    child_ids: list[str]
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    sequences: dict[str, _Sequence] = field(default_factory=dict)
    num_cached_tokens: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig, checkpoint: Checkpoint | None = None) -> None:
        started = time.monotonic()
        self.config = config
        # How torch's CPU threads are placed (native/platform.py); the thread that steps the
        # engine, if not this one, pins its own team with platform.bind_compute_threads.
        self.cpu_threads = platform.set_cpu_threads(config.load.cpu_threads_bind)
        checkpoint = checkpoint or load_checkpoint(config.load.model)
        self.model_name = checkpoint.name
        self.model_config = checkpoint.config
        self.device = platform.resolve_device(config.load.device)
        self.dtype = platform.resolve_dtype(
            config.load.dtype, self.device, checkpoint.config.torch_dtype
        )
        self.attention = select_backend(config.load.attention_backend, self.device)
        self.tokenizer = load_tokenizer(checkpoint.path)
        self.eos_token_ids = frozenset(checkpoint.config.eos_token_ids) | (
            {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()
        )
        self.executor: TensorParallelExecutor | None = None
        if config.load.tensor_parallel_size > 1:  # rank 0 here, the other ranks started
            from kvserve.executor.tensor_parallel import TensorParallelExecutor

            self.executor = TensorParallelExecutor(
                config.load, checkpoint, self.dtype, self.device, self.cpu_threads
            )
            self.cpu_threads = self.executor.cpu_threads  # rank 0's share of the CPUs
            self.model = self.executor.model
        else:
            model_cls = get_model_class(checkpoint.config.architecture)
            self.model = model_cls.from_weights(
                checkpoint.config, checkpoint.weights, self.dtype, self.device
            )
        del checkpoint.weights
        self.model_path = checkpoint.path
        try:
            self._start_runtime(config)
        except BaseException:
            if self.executor is not None:
                self.executor.shutdown()
            raise
        self._user_requests: dict[str, _UserRequest] = {}
        self._child_to_user: dict[str, str] = {}
        self._log_startup(time.monotonic() - started)

    # ----------------------------------------------------------------- start-up
    def _start_runtime(self, config: EngineConfig) -> None:
        self.config = self._checked_kv_cache_dtype(config)
        self.max_model_len = self._resolve_max_model_len()
        self.graph_plan = self._plan_cuda_graphs()
        self.sizing = self._size_kv_cache()
        self._build_runtime()
        self._choose_layer_kernels()  # its warm-up writes into the first blocks: before any load
        if self.graph_plan is not None:  # after the compile: graphs record compiled kernels
            self.runner.capture_cuda_graphs(self.graph_plan, pad_block_id=self.sizing.num_blocks)
        self._open_prefix_store()

    def _resolve_max_model_len(self) -> int:
        """ValueError for a length beyond the trained context without the override."""
        trained = self.model_config.max_position_embeddings
        sched = self.config.scheduler
        length = resolve_max_model_len(sched.max_model_len, trained, sched.allow_long_max_model_len)
        if length > trained:
            logger.warning(
                "--max-model-len %d exceeds the model's trained context of %d tokens "
                "(allowed by the override): outputs past it may degrade", length, trained,
            )  # fmt: skip
        return length

    def _size_kv_cache(self) -> KVCacheSizing:
        cache = self.config.cache
        mc = self.model_config
        spec = kv_cache_spec(
            mc.num_layers, mc.num_kv_heads, mc.head_dim, cache.kv_cache_dtype,
            platform.dtype_name(self.dtype), cache.block_size,
            self.config.load.tensor_parallel_size,
        )  # fmt: skip  # per rank: the largest rank's KV heads, rank 0's weights
        weights = itertools.chain(self.model.parameters(), self.model.buffers())  # + packed
        weights_bytes = sum(t.numel() * t.element_size() for t in weights)
        plan = self.graph_plan
        num_tokens = self.config.scheduler.max_num_batched_tokens
        profile = (
            partial(self.executor.profile_peak_activation_bytes, spec, num_tokens)
            if self.executor is not None
            else partial(profile_peak_activation_bytes, self.model, spec, num_tokens,
                         self.attention, self.device)
        )  # fmt: skip
        budget = kv_budget_bytes(
            cache,
            self.device,
            weights_bytes,
            profile,
            lambda: (
                0 if plan is None
                else profile_graph_pool_bytes(self.model, spec, self.attention, self.device, plan)
            ),
        )  # fmt: skip
        sizing = size_kv_cache(spec, budget, self.max_model_len)
        if cache.kv_offloading_size is None:
            return sizing
        host = measure_host_memory()
        return size_host_tier(sizing, cache.kv_offloading_size, self.device, host)

    def _checked_kv_cache_dtype(self, config: EngineConfig) -> EngineConfig:
        """The config with the KV dtype the start-up check settles on (an 8-bit one is
        checked against the model's dtype; ParameterError when it fails and may not fall
        back)."""
        cache = config.cache
        if self.executor is not None:  # the canary would run rank 0's shard alone
            cache = replace(cache, kv_cache_dtype_check="off")
        kv_dtype = check_kv_cache_dtype(
            cache,
            lambda: Canary(
                self.model, self.model_config, self.tokenizer, self.dtype,
                config.cache.block_size, self.device,
            ),
        )  # fmt: skip
        return replace(config, cache=replace(config.cache, kv_cache_dtype=kv_dtype))

    def _build_runtime(self) -> None:
        spec = self.sizing.spec
        cache = self.config.cache
        # With CUDA graphs, one block more than the pool's: the pad rows' scratch block.
        num_pad_blocks = 0 if self.graph_plan is None else 1
        num_host = self.sizing.num_host_blocks
        if self.executor is not None:  # every rank allocates the same blocks for its heads
            self.executor.init_kv_caches(spec, self.sizing.num_blocks, num_host)
            self.kv_caches = self.executor.kv_caches
        else:
            self.kv_caches = allocate_kv_caches(
                spec, self.sizing.num_blocks + num_pad_blocks, self.device
            )
        host_kv_caches = (
            allocate_kv_caches(spec, num_host, CPU, pin_memory=self.device.type == "cuda")
            if num_host and self.executor is None else None
        )  # fmt: skip
        self.services = PrefixCacheServices(cache, self.device)
        self.cache_manager = KVCacheManager(
            self.sizing.num_blocks,
            spec.block_size,
            enable_caching=cache.enable_prefix_caching,
            extra_key=spec.dtype.encode(),
            public_prefixes=(
                public_prefix_token_ids(cache.public_prefixes, self.tokenizer)
                if cache.public_prefixes else ()
            ),
            enable_events=self.services.wants_events,
            track_new_blocks=self.services.wants_new_blocks,
            num_host_blocks=num_host,
            report_cross_salt_misses=cache.enable_cross_salt_miss_reason,
        )  # fmt: skip
        sched = self.config.scheduler
        self.scheduler = Scheduler(
            sched.max_num_seqs, sched.max_num_batched_tokens, self.max_model_len,
            self.cache_manager,
        )  # fmt: skip
        self.runner: ModelRunner | TensorParallelExecutor = self.executor or ModelRunner(
            self.model, self.kv_caches, self.attention, spec.block_size, self.device,
            seed=self.config.load.seed, host_kv_caches=host_kv_caches,
        )  # fmt: skip

    def _open_prefix_store(self) -> None:
        """Load the blocks of --prefix-cache-dir whose fingerprint matches (cold cached)."""
        if not self.config.cache.enable_prefix_caching:
            return
        spec, mc = self.sizing.spec, self.model_config
        shape = f"{mc.num_layers}x{mc.num_kv_heads}x{mc.head_dim}"
        print_ = fingerprint(
            self.model_path, platform.dtype_name(self.dtype), spec.dtype,
            spec.block_size, shape, self.tokenizer,
        )  # fmt: skip
        self.services.open_store(print_, self.kv_caches, self.cache_manager)

    def _plan_cuda_graphs(self) -> GraphPlan | None:
        load, sched = self.config.load, self.config.scheduler
        if self.executor is not None:  # the ranks run eagerly (docs/tensor_parallel.md)
            return None
        return decode_graph_plan(
            self.device, load.enforce_eager, self.attention, sched.max_num_seqs,
            self.max_model_len, self.config.cache.block_size,
        )  # fmt: skip

    def _choose_layer_kernels(self) -> None:
        """The layers' native path where it serves this model (models/native_layers.py: every
        step, no compiler needed), else torch.compile of the layers; neither with
        --enforce-eager.  A compiler that fails (no C++ compiler, an unsupported op) leaves the
        model eager, with a warning, never a failed start."""
        if self.config.load.enforce_eager:
            return
        if self.executor is not None:
            logger.info("tensor parallel runs eagerly (torch.compile is not used with > 1 rank)")
            return
        if self._native_layers_warmed_up():
            logger.info("the layers run their native path (csrc/decode_layer.c) at every step")
            return
        started = time.monotonic()
        self.model.compile()
        try:
            self.runner.warm_up()
        except Exception as exc:  # noqa: BLE001 - any compiler failure: fall back to eager
            logger.warning("torch.compile failed, running eagerly (%s: %s)", type(exc).__name__,
                           str(exc).splitlines()[0] if str(exc) else "")  # fmt: skip
            self.model.kernels = EAGER
            return
        logger.info("compiled the layers with torch.compile in %.1fs", time.monotonic() - started)

    def _native_layers_warmed_up(self) -> bool:
        """The layers' C path (models/native_layers.py) where it serves this model, warmed up
        here.  One that fails leaves the model to torch.compile."""
        if not self.model.use_native_layers():
            return False
        try:
            self.runner.warm_up()
        except Exception as exc:  # noqa: BLE001 - any failure: compile the layers instead
            first_line = str(exc).splitlines()[0] if str(exc) else ""
            logger.warning("the native layers failed, compiling the layers instead (%s: %s)",
                           type(exc).__name__, first_line)  # fmt: skip
            self.model.native_layers = None
            return False
        return True

    def _log_startup(self, seconds: float) -> None:
        mc = self.model_config
        logger.info(
            "model %s (%s, %d layers, %d heads / %d KV heads, head_dim %d) on %s in %s, "
            "attention %s, loaded in %.1fs",
            self.model_name, mc.architecture, mc.num_layers, mc.num_heads, mc.num_kv_heads,
            mc.head_dim, self.device, platform.dtype_name(self.dtype),
            type(self.attention).__name__, seconds,
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
    ) -> None:
        """Queue a request (n children for n > 1).  ValueError for one that can never fit.
        Its cached blocks are shared only with requests of the same `cache_salt` (and the
        public prefixes with every request)."""
        if request_id in self._user_requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        vocab_size = self.model_config.vocab_size
        params.check_against(vocab_size, self.config.limits)
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ParameterError("prompt", f"token ids must be in [0, {vocab_size}), got {bad}")
        child_ids = (
            [request_id] if params.n == 1 else [f"{request_id}-{i}" for i in range(params.n)]
        )
        children = [
            Request(
                request_id=child_id,
                prompt_token_ids=token_ids,
                sampling_params=self._child_params(params, i),
                eos_token_ids=self.eos_token_ids,
                arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
                fork_of=child_ids[0] if i else None,
                cache_salt=cache_salt,
            )
            for i, child_id in enumerate(child_ids)
        ]
        added = []
        try:
            for child in children:
                self.scheduler.add_request(child)
                added.append(child.request_id)
        except ValueError:
            for child_id in added:
                self.scheduler.finish_request(child_id, RequestStatus.FINISHED_ABORTED)
            raise
        user = _UserRequest(request_id, text, token_ids, child_ids, params.output_kind)
        for child in children:
            user.sequences[child.request_id] = self._new_sequence(child.sampling_params)
            self._child_to_user[child.request_id] = request_id
        self._user_requests[request_id] = user

    @staticmethod
    def _child_params(params: SamplingParams, index: int) -> SamplingParams:
        """Child i of an n-sample request samples with seed + i (reproducible per sample)."""
        seed = None if params.seed is None else params.seed + index
        return replace(params, n=1, seed=seed)

    def _new_sequence(self, params: SamplingParams) -> _Sequence:
        detok = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
        stops = StopStrings(params.stop, params.include_stop_str_in_output)
        return _Sequence(detok, stops, [] if params.logprobs is not None else None)

    def abort_request(self, request_id: str) -> None:
        """Stop a user request now; its blocks are freed at once."""
        user = self._user_requests.pop(request_id, None)
        if user is None:
            return
        for child_id in user.child_ids:
            self.scheduler.finish_request(child_id, RequestStatus.FINISHED_ABORTED)
            self._child_to_user.pop(child_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._user_requests)

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

    def reset_prefix_cache(self) -> int:
        """Drop every cached block no request holds (and the store on disk); how many."""
        num_dropped = self.services.reset(self.cache_manager)
        logger.info("prefix cache reset: %d cached blocks dropped", num_dropped)
        return num_dropped

    def close(self) -> None:
        """Write the prefix cache store, stop the KV event publisher and the tensor-parallel
        ranks (idempotent)."""
        self.services.close(self.cache_manager)
        if self.executor is not None:
            self.executor.shutdown()

    def on_executor_failure(self, callback: Callable[[BaseException], None]) -> None:
        """`callback(error)` when a tensor-parallel rank dies, from another thread, even while
        no step runs (no-op with one rank)."""
        if self.executor is not None:
            self.executor.set_failure_callback(callback)

    # ----------------------------------------------------------------- one step
    def step(self) -> list[RequestOutput]:
        """One step.  When anything after scheduling raises (the model, the sampler, the
        detokenizer), only the user requests of this step are aborted (blocks freed) and
        StepFailedError names them; the engine can go on.  EngineCorruptedError when the
        block bookkeeping no longer adds up afterwards: the engine must not go on."""
        with record_function("kvserve::schedule"):
            scheduler_output = self.scheduler.schedule()
        try:
            outputs = self._run_scheduled(scheduler_output)
        except ExecutorFailedError:
            raise  # the ranks disagree from now on: no step can run
        except Exception as exc:
            failed = self._abort_step(scheduler_output)
            if scheduler_output.blocks_to_host or scheduler_output.blocks_from_host:
                # The host tier's copies may not have run: forget what either tier caches.
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
        failed = {
            self._child_to_user[item.request_id]: None
            for item in scheduler_output.scheduled
            if item.request_id in self._child_to_user
        }
        for user_id in failed:
            self.abort_request(user_id)
        return list(failed)

    def _run_scheduled(self, scheduler_output: SchedulerOutput) -> list[RequestOutput]:
        """Model, then bookkeeping and detokenization (each a profiler range, named for the
        breakdown in benchmarks/side_by_side.py; free when no profiler runs)."""
        with record_function("kvserve::model"):
            runner_output = self.runner.execute(scheduler_output)
        with record_function("kvserve::update_detokenize"):
            updated = self.scheduler.update_from_output(
                scheduler_output, runner_output.sampled_token_ids
            )
            touched: dict[str, None] = {}
            for request in updated:
                user_id = self._child_to_user.get(request.request_id)
                if user_id is None:
                    continue
                self._process_token(request, runner_output.logprobs.get(request.request_id))
                touched[user_id] = None
            outputs = (self._make_output(user_id) for user_id in touched)
            return [output for output in outputs if output is not None]

    def _process_token(self, request: Request, logprobs: TokenLogprobs | None) -> None:
        user = self._user_requests[self._child_to_user[request.request_id]]
        seq = user.sequences[request.request_id]
        num_old_chars = len(seq.detokenizer.text)
        seq.detokenizer.add(request.output_token_ids[-1:])
        cut = seq.stop_strings.cut(seq.detokenizer.text, num_old_chars)
        if cut is not None:
            seq.detokenizer.text, seq.stopped_by = cut
        if seq.logprobs is not None and logprobs is not None:
            seq.logprobs.append(logprobs)
        if user.num_cached_tokens == 0 and request.num_cached_tokens > 0:
            user.num_cached_tokens = request.num_cached_tokens
        if seq.stopped_by is not None and not request.status.finished:
            self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
            request.stop_reason = seq.stopped_by
        if request.status.finished:
            seq.finish_reason = request.status.finish_reason
            seq.stop_reason = request.stop_reason or seq.stopped_by

    def _make_output(self, user_id: str) -> RequestOutput | None:
        """The user request's output after this step, as its output_kind asks (None: nothing
        to send, a FINAL_ONLY request still running)."""
        user = self._user_requests[user_id]
        finished = all(user.sequences[c].finish_reason is not None for c in user.child_ids)
        if finished:
            del self._user_requests[user_id]
            for child_id in user.child_ids:
                self._child_to_user.pop(child_id, None)
        elif user.output_kind is RequestOutputKind.FINAL_ONLY:
            return None
        outputs = [
            user.sequences[child_id].completion(index, user.output_kind)
            for index, child_id in enumerate(user.child_ids)
        ]
        return RequestOutput(
            request_id=user_id,
            prompt=user.prompt,
            prompt_token_ids=user.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            num_cached_tokens=user.num_cached_tokens,
        )
