"""The engine's side of tensor parallelism: rank 0 in this process, the other ranks started
by a launcher (worker processes, or Ray actors), a monitor that notices a rank dying.

Any failure inside a step is fatal here (ExecutorFailedError), unlike a single-process step
that fails only its requests: once one rank has left a collective the ranks no longer agree
on which collective comes next, and the only safe answer is to stop serving (the server then
exits non-zero and its supervisor restarts it).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist

from kvserve.attention.kv_cache import LayerKVCache
from kvserve.config import EngineConfig, format_bytes
from kvserve.errors import ParameterError
from kvserve.executor.abstract import Executor
from kvserve.executor.base import (
    CpuThreadPlan,
    ExecutorFailedError,
    WorkerSpec,
    bind_compute_threads,
    split_cpu_plan,
)
from kvserve.executor.collective import STORE_TIMEOUT, broadcast_object
from kvserve.executor.kv_shards import ShardedKVCache
from kvserve.executor.worker import Worker
from kvserve.kv.spec import KVCacheSpec
from kvserve.models.loader import Checkpoint
from kvserve.models.parallel import shard_plan

logger = logging.getLogger("kvserve")

WORKER_START_TIMEOUT_S = 600.0
DEATH_REPORT_WAIT_S = 2.0  # after a failed collective: how long to wait to name the dead rank


class Launcher(Protocol):
    """Starts ranks 1..N-1 somewhere and says when one of them dies."""

    host: str  # the address the ranks reach this process's TCPStore at

    def start(self, spec: WorkerSpec) -> None: ...

    def worker_pids(self) -> dict[int, int]:
        """rank -> process id (on whichever machine runs it)."""
        ...

    def dead_rank(self) -> tuple[int, str] | None:
        """(rank, what happened) of a rank that is gone, without blocking."""
        ...

    def wait_for_death(self) -> tuple[int, str] | None:
        """Block until a rank dies (its report) or `stop` is called (None)."""
        ...

    def stop(self) -> None: ...


def make_launcher(backend: str) -> Launcher:
    if backend == "ray":
        try:
            import ray  # noqa: F401
        except ImportError:
            raise ParameterError(
                "--distributed-executor-backend",
                "ray needs Ray: pip install 'kvserve[ray]' (or use mp)",
            ) from None
        from kvserve.executor.ray_actors import RayLauncher

        return RayLauncher()
    from kvserve.executor.mp import MultiprocLauncher

    return MultiprocLauncher()


class TensorParallelExecutor(Executor):
    """Executor over N ranks: rank 0's Worker in this process (`driver_worker`: the engine
    sizes the KV cache from its weights), the others started by a launcher."""

    def __init__(
        self,
        config: EngineConfig,
        checkpoint: Checkpoint,
        dtype: str,
        device: torch.device,
        cpu_threads: CpuThreadPlan | None = None,
        launcher: Launcher | None = None,
    ) -> None:
        """`cpu_threads`: the engine's --cpu-threads-bind plan, shared out among the ranks;
        `self.cpu_threads` is rank 0's share, for the engine thread to bind to."""
        load = config.load
        self.config = config
        size = load.tensor_parallel_size
        shard_plan(checkpoint.config, size)  # ParameterError for a size the heads refuse
        self.tensor_parallel_size = size
        self.backend_name = load.distributed_executor_backend
        self.failure: ExecutorFailedError | None = None
        self._on_failure: Callable[[ExecutorFailedError], None] | None = None
        self._closed = False
        self.launcher = launcher or make_launcher(load.distributed_executor_backend)
        cpu_plans = (
            split_cpu_plan(cpu_threads, size, pin_workers=load.distributed_executor_backend == "mp")
            if device.type == "cpu" else (None,) * size
        )  # fmt: skip
        self.cpu_threads = cpu_plans[0]  # rank 0's share: the engine thread binds to it
        if self.cpu_threads is not None:
            torch.set_num_threads(len(self.cpu_threads.compute_cpus))
            bind_compute_threads(self.cpu_threads)
        self._store = dist.TCPStore(
            self.launcher.host, 0, size, True, timeout=STORE_TIMEOUT, wait_for_workers=False
        )
        spec = WorkerSpec(
            config, dtype, device.type, store_host=self.launcher.host,
            store_port=self._store.port, cpu_plans=cpu_plans,
        )  # fmt: skip
        started = time.monotonic()
        self.launcher.start(spec)
        try:
            self.driver_worker = Worker(spec, 0, checkpoint)
            self.driver_worker.join(self._store, self._wait_for_ranks)
        except BaseException:
            self.launcher.stop()
            raise
        logger.info(
            "tensor parallel: %d ranks (%s, %s), ready in %.1fs; rank 0 holds %d/%d query "
            "heads, %d/%d KV heads, %s of weights",
            size, self.backend_name, spec.group_backend, time.monotonic() - started,
            len(self.driver_worker.shard.q_heads), self.driver_worker.model_config.num_heads,
            len(self.driver_worker.shard.kv_heads), self.driver_worker.model_config.num_kv_heads,
            format_bytes(self.driver_worker.weight_bytes()),
        )  # fmt: skip
        pids = ", ".join(f"rank {r} pid {p}" for r, p in self.launcher.worker_pids().items())
        logger.info("tensor parallel: rank 0 pid %d (this process), %s", os.getpid(), pids)
        self._monitor = threading.Thread(target=self._watch, name="kvserve-tp-monitor", daemon=True)
        self._monitor.start()

    # ------------------------------------------------------------------ start-up
    def _wait_for_ranks(self) -> None:
        """Every rank has built its model (a rank that dies while loading is named)."""
        keys = [f"ready/{rank}" for rank in range(1, self.tensor_parallel_size)]
        deadline = time.monotonic() + WORKER_START_TIMEOUT_S
        while not self._store.check(keys):
            dead = self.launcher.dead_rank()
            if dead is not None:
                raise ExecutorFailedError(
                    f"tensor-parallel worker rank {dead[0]} failed to start: {dead[1]}"
                )
            if time.monotonic() > deadline:
                raise ExecutorFailedError(
                    f"tensor-parallel workers not ready after {WORKER_START_TIMEOUT_S:.0f}s"
                )
            time.sleep(0.1)

    def initialize_kv_caches(
        self,
        spec: KVCacheSpec,
        num_blocks: int,
        num_host: int,
        host_dtype: str | None = None,
        disk_dir: str | None = None,
    ) -> None:
        super().initialize_kv_caches(spec, num_blocks, num_host, host_dtype, disk_dir)
        logger.info(
            "tensor parallel: KV cache per rank %s (rank 0: %d KV heads, %s bytes/token)",
            format_bytes(self.driver_worker.kv_cache_bytes()), spec.num_kv_heads,
            f"{spec.bytes_per_token:,}",
        )  # fmt: skip

    @property
    def kv_caches(self) -> list[ShardedKVCache]:  # type: ignore[override]
        """Every rank's KV cache as one, per distinct cache (the prefix store's view: rows
        gathered from and scattered to the ranks; executor/kv_shards.py)."""
        distinct: dict[int, tuple[int, LayerKVCache]] = {}
        for layer, cache in enumerate(self.driver_worker.kv_caches):
            distinct.setdefault(id(cache), (layer, cache))
        heads = self.driver_worker.model_config.num_kv_heads
        return [
            ShardedKVCache(self.collective_rpc, layer, cache, heads)
            for layer, cache in distinct.values()
        ]

    # ------------------------------------------------------------------ steps
    def set_failure_callback(self, callback: Callable[[ExecutorFailedError], None]) -> None:
        """`callback(error)` runs on the monitor thread when a rank dies (even when idle)."""
        self._on_failure = callback

    def collective_rpc(self, method: str, *args: object):  # noqa: ANN201 - the method's result
        """Run `method(*args)` on every rank; rank 0's result.  ExecutorFailedError for any
        failure (see the module docstring)."""
        if self.failure is not None:
            raise self.failure
        try:
            broadcast_object(self.driver_worker.cpu_group, (method, args))
            return getattr(self.driver_worker, method)(*args)
        except Exception as exc:
            raise self._failure_from(exc) from exc

    def _failure_from(self, exc: Exception) -> ExecutorFailedError:
        """The dead rank's report when there is one (it may take a moment to be seen)."""
        deadline = time.monotonic() + DEATH_REPORT_WAIT_S
        while self.failure is None and time.monotonic() < deadline:
            dead = self.launcher.dead_rank()
            if dead is not None:
                self._record_death(*dead)
                break
            time.sleep(0.05)
        if self.failure is None:
            self.failure = ExecutorFailedError(
                f"a tensor-parallel step failed on rank 0 ({type(exc).__name__}: {exc}); the "
                "ranks can no longer agree"
            )
        return self.failure

    # ------------------------------------------------------------------ failures
    def _watch(self) -> None:
        try:
            dead = self.launcher.wait_for_death()
        except Exception:  # noqa: BLE001 - the launcher went down under the monitor
            if self._closed:
                return
            logger.exception("tensor parallel: the worker monitor failed")
            dead = (-1, "the worker monitor failed")
        if dead is None or self._closed:
            return
        self._record_death(*dead)
        if self._on_failure is not None and self.failure is not None:
            self._on_failure(self.failure)

    def _record_death(self, rank: int, detail: str) -> None:
        if self.failure is not None:
            return
        self.failure = ExecutorFailedError(f"tensor-parallel worker rank {rank} died ({detail})")
        logger.critical("%s: the engine cannot go on", self.failure)

    def shutdown(self) -> None:
        """Stop every rank (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self.failure is None:
            try:
                broadcast_object(self.driver_worker.cpu_group, None)
            except Exception:  # noqa: BLE001 - a rank already gone: stop the others anyway
                logger.warning("tensor parallel: could not tell every rank to stop")
        self.launcher.stop()
