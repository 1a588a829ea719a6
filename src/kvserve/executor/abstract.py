"""The executor the engine steps through, for any number of ranks: `make_executor` picks one
(executor/uniproc.py for one rank, executor/tensor_parallel.py for N), and every start-up call
and every step reaches each rank's Worker (executor/worker.py) through `collective_rpc`.

The engine's start-up, in this order (vLLM's EngineCore: executor, memory, caches, warm-up):

    make_executor(config)        every rank loads and builds its model
    calibrate_key_offsets        a 4-bit cache's key offsets, on every rank
    check_kv_cache_dtype         the quantized KV check, on every rank
    determine_kv_budget_bytes    the graph plan and the profiles, on every rank; rank 0's bytes
    initialize_kv_caches         the same block count on every rank
    warm_up                      native layers or torch.compile, then CUDA graphs
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvserve.config import EngineConfig, ModelConfig
from kvserve.errors import ParameterError
from kvserve.executor.base import (
    CpuThreadPlan,
    ExecutorFailedError,
)
from kvserve.executor.kv_dtype_check import canary_token_ids, wants_check
from kvserve.executor.memory import HostMemory, kv_budget_bytes, measure_host_memory
from kvserve.kv.spec import KVCacheSpec
from kvserve.kv_quant import ROTATED_DTYPES, ROTATED_ROWS_VERSION
from kvserve.models.loader import Checkpoint as Checkpoint
from kvserve.runner.disk_tier import block_file, keys_in  # the engine names them through here
from kvserve.step import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from kvserve.attention.kv_cache import LayerKVCache
    from kvserve.executor.worker import Worker


class Executor(ABC):
    """Every rank's Worker behind one object; `driver_worker` is rank 0's, in this process."""

    config: EngineConfig
    driver_worker: Worker
    cpu_threads: CpuThreadPlan | None  # rank 0's share: the engine thread binds to it

    @abstractmethod
    def collective_rpc(self, method: str, *args: object) -> Any:
        """Worker.`method`(*args) on every rank; rank 0's result."""

    def set_failure_callback(  # noqa: B027 - one rank never fails apart from the engine
        self, callback: Callable[[ExecutorFailedError], None]
    ) -> None:
        """`callback(error)` when a rank dies, from another thread (never, with one rank)."""

    def shutdown(self) -> None:  # noqa: B027 - one rank has nothing to stop
        """Stop every rank other than this process's (idempotent)."""

    # ------------------------------------------------------------------ the model
    @property
    def model_config(self) -> ModelConfig:
        return self.driver_worker.model_config  # the whole model's, not a shard's

    @property
    def model_name(self) -> str:
        return self.driver_worker.model_name

    @property
    def model_path(self) -> Path:
        """The checkpoint's file or directory (it also holds the tokenizer)."""
        return self.driver_worker.model_path

    @property
    def device(self) -> torch.device:
        return self.driver_worker.device

    @property
    def dtype(self) -> torch.dtype:
        return self.driver_worker.dtype

    @property
    def dtype_name(self) -> str:
        """The model dtype as --dtype and the KV accounting spell it ("bfloat16")."""
        return self.driver_worker.spec.dtype

    @property
    def attention_name(self) -> str:
        return type(self.driver_worker.backend).__name__

    @property
    def kv_caches(self) -> list[LayerKVCache]:
        """Rank 0's KV cache tensors (all of them with one rank)."""
        return self.driver_worker.kv_caches

    # ------------------------------------------------------------------ start-up
    @staticmethod
    def rotated_rows(kv_dtype: str) -> str | None:
        """What a cache of `kv_dtype` holds where its rows are rotated (for the prefix store's
        fingerprint: kv_quant.ROTATED_ROWS_VERSION), else None."""
        return ROTATED_ROWS_VERSION if kv_dtype in ROTATED_DTYPES else None

    def calibrate_key_offsets(self, tokenizer: object) -> None:
        """A rotated (4-bit) --kv-cache-dtype: each layer's key offset, on every rank, from
        the canary text (runner/key_offsets.py); nothing for the other dtypes.  Before the
        dtype check, whose canary runs with them."""
        if self.config.cache.kv_cache_dtype in ROTATED_DTYPES:
            self.collective_rpc("calibrate_key_offsets", canary_token_ids(tokenizer))

    def check_kv_cache_dtype(self, tokenizer: object) -> str:
        """The --kv-cache-dtype to use (executor/kv_dtype_check.py); ParameterError when an
        8-bit one fails and may not fall back."""
        cache = self.config.cache
        if not wants_check(cache):
            return cache.kv_cache_dtype
        verdict = self.collective_rpc("check_kv_cache_dtype", cache, canary_token_ids(tokenizer))
        if isinstance(verdict, ParameterError):
            raise verdict
        return verdict

    def determine_kv_budget_bytes(self, spec: KVCacheSpec, max_model_len: int) -> int:
        """Bytes rank 0's device has for its KV cache (executor/memory.py), after every rank
        planned its CUDA graphs; CapacityError when there are none."""
        sched = self.config.scheduler
        self.collective_rpc("plan_cuda_graphs", sched.max_num_seqs, max_model_len,
                            spec.block_size)  # fmt: skip
        return kv_budget_bytes(
            self.config.cache, self.device, self.driver_worker.weight_bytes(),
            lambda: self.collective_rpc("profile_peak_activation_bytes", spec,
                                        sched.max_num_batched_tokens),
            lambda: self.collective_rpc("profile_graph_pool_bytes", spec),
        )  # fmt: skip

    def disk_tier_keys(self, disk_dir: Path) -> list[bytes]:
        """The block keys the disk tier's folder holds already, oldest first (listed, not
        read: --kv-offloading-dir)."""
        return keys_in(disk_dir)

    def disk_tier_probe(self, disk_dir: Path) -> Callable[[bytes], bool]:
        """Whether the disk tier's folder holds a key's block files now, every rank's (files
        another server on the folder wrote since this one listed it).  The folder is rank
        0's view: with ranks on other machines a rank whose file is missing fails its read,
        which makes the block a miss (executor/disk_reads.py)."""
        ranks = range(self.driver_worker.world_size)
        return lambda key: all(block_file(disk_dir, key, rank).is_file() for rank in ranks)

    def measure_host_memory(self) -> HostMemory:
        """This machine's RAM (the host tier's; after the weights are loaded)."""
        return measure_host_memory()

    def initialize_kv_caches(
        self,
        spec: KVCacheSpec,
        num_blocks: int,
        num_host: int,
        host_dtype: str | None = None,
        disk_dir: str | None = None,
    ) -> None:
        """Every rank allocates `num_blocks` device blocks and `num_host` host-tier blocks (the
        same ids on every rank) for its KV heads, in `host_dtype` (int8: compressed; None: the
        cache's dtype), with the disk tier's files in `disk_dir` (None: no disk tier)."""
        self.collective_rpc(
            "initialize_kv_caches", spec, num_blocks, num_host, host_dtype, disk_dir
        )

    def warm_up(self) -> None:
        self.collective_rpc("warm_up")

    # ------------------------------------------------------------------ steps
    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        return self.collective_rpc("execute", output)
