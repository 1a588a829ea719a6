"""One tensor-parallel rank: its shard of the model, its share of the KV cache, its runner, and
the loop by which ranks other than 0 follow the engine's calls.

Rank 0 lives in the engine process; ranks 1..N-1 run `run_worker` in a worker process or a
Ray actor.  Every call reaches every rank in the same order, as a pickled (method, args) that
rank 0 broadcasts over the CPU (gloo) group; None ends the loop.
"""

from __future__ import annotations

import datetime
import logging
import pickle
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from kvserve.attention import select_backend
from kvserve.attention.kv_cache import LayerKVCache, allocate_kv_caches
from kvserve.executor.base import WorkerSpec
from kvserve.kv.spec import KVCacheSpec
from kvserve.models.loader import Checkpoint, load_checkpoint
from kvserve.models.parallel import TPGroup, build_sharded_model, shard_plan
from kvserve.models.registry import get_model_class
from kvserve.native import platform
from kvserve.runner.model_runner import ModelRunner, profile_peak_activation_bytes
from kvserve.step import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger("kvserve")

# An idle server waits for its next step inside a broadcast: the collective timeout must not
# end it.  A rank that dies is seen at once anyway (its sockets close; the executor's monitor
# watches the processes), so the timeout only bounds a peer that hangs without dying.
COLLECTIVE_TIMEOUT = datetime.timedelta(days=365)
STORE_TIMEOUT = datetime.timedelta(seconds=600)


def rank_device(device: str, rank: int) -> torch.device:
    """A CPU for every rank, or rank r's GPU (a Ray actor sees only its own GPU, as cuda:0)."""
    if device != "cuda":
        return torch.device("cpu")
    return torch.device("cuda", rank % torch.cuda.device_count())


def make_process_group(
    store: dist.Store, prefix: str, backend: str, rank: int, world_size: int
) -> Any:
    """A process group of its own (not torch's global default group)."""
    prefixed = dist.PrefixStore(prefix, store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, world_size, COLLECTIVE_TIMEOUT)
    return dist.ProcessGroupNCCL(prefixed, rank, world_size)


def broadcast_object(group: TPGroup, obj: object) -> None:
    """Rank 0: send one picklable object to every other rank (size, then bytes)."""
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    group.process_group.broadcast(torch.tensor([payload.numel()]), 0).wait()
    group.process_group.broadcast(payload, 0).wait()


def receive_object(group: TPGroup) -> Any:
    """Ranks > 0: the next object rank 0 broadcasts."""
    size = torch.zeros(1, dtype=torch.long)
    group.process_group.broadcast(size, 0).wait()
    payload = torch.empty(int(size), dtype=torch.uint8)
    group.process_group.broadcast(payload, 0).wait()
    return pickle.loads(payload.numpy().tobytes())


class Worker:
    """One rank.  Built in two steps like the engine's start-up: the model first (the engine
    sizes the KV cache from rank 0's weights), then `init_kv_caches` with the block count
    every rank must share."""

    def __init__(
        self,
        spec: WorkerSpec,
        rank: int,
        store: dist.Store,
        checkpoint: Checkpoint | None = None,
        before_join: Callable[[], None] | None = None,
    ) -> None:
        self.spec = spec
        self.rank = rank
        self.device = rank_device(spec.device, rank)
        checkpoint = checkpoint or load_checkpoint(spec.model)
        self.shard = shard_plan(checkpoint.config, spec.tensor_parallel_size)[rank]
        size = spec.tensor_parallel_size
        self.device_group = TPGroup(None, rank, size)
        self.model = build_sharded_model(
            get_model_class(checkpoint.config.architecture), checkpoint.config,
            checkpoint.weights, self.shard, self.device_group, getattr(torch, spec.dtype),
            self.device,
        )  # fmt: skip
        self.backend = select_backend(spec.attention_backend, self.device)
        self.kv_caches: list[LayerKVCache] = []
        self.runner: ModelRunner | None = None
        store.set(f"ready/{rank}", "1")
        if before_join is not None:
            before_join()
        self.device_group.process_group = make_process_group(
            store, "device", spec.group_backend, rank, size
        )
        self.cpu_group = self.device_group
        if spec.group_backend != "gloo":
            self.cpu_group = TPGroup(
                make_process_group(store, "cpu", "gloo", rank, size), rank, size
            )

    def local_spec(self, spec: KVCacheSpec) -> KVCacheSpec:
        """The engine's spec (sized for the largest share) with this rank's KV heads."""
        return replace(spec, num_kv_heads=len(self.shard.kv_heads))

    def init_kv_caches(self, spec: KVCacheSpec, num_blocks: int, num_host_blocks: int = 0) -> None:
        """`num_blocks` device blocks (and `num_host_blocks` of the --kv-offloading-size host
        tier) for this rank's KV heads; the block ids are every rank's."""
        local = self.local_spec(spec)
        self.kv_caches = allocate_kv_caches(local, num_blocks, self.device)
        host_kv_caches = (
            allocate_kv_caches(local, num_host_blocks, torch.device("cpu"),
                               pin_memory=self.device.type == "cuda")
            if num_host_blocks else None
        )  # fmt: skip
        self.runner = ModelRunner(
            self.model, self.kv_caches, self.backend, spec.block_size, self.device,
            seed=self.spec.seed, host_kv_caches=host_kv_caches,
        )  # fmt: skip

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        assert self.runner is not None, "init_kv_caches first"
        return self.runner.execute(output)

    def warm_up(self) -> None:
        assert self.runner is not None, "init_kv_caches first"
        self.runner.warm_up()

    def profile_peak_activation_bytes(self, spec: KVCacheSpec, num_tokens: int) -> int:
        return profile_peak_activation_bytes(
            self.model, self.local_spec(spec), num_tokens, self.backend, self.device
        )

    def weight_bytes(self) -> int:
        tensors = list(self.model.parameters()) + list(self.model.buffers())
        return sum(t.numel() * t.element_size() for t in tensors)

    def kv_cache_bytes(self) -> int:
        tensors = [t for c in self.kv_caches for t in (c.key, c.value, c.key_scale, c.value_scale)]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def run_worker(spec: WorkerSpec, rank: int) -> None:
    """A rank > 0 from start to end: join, then follow rank 0's calls until it sends None."""
    cpu_plan = spec.cpu_plans[rank]
    if cpu_plan is not None:  # this process's main thread runs the steps: its team
        torch.set_num_threads(len(cpu_plan.compute_cpus))
        platform.bind_compute_threads(cpu_plan)
    store = dist.TCPStore(
        spec.store_host, spec.store_port, spec.tensor_parallel_size, False, timeout=STORE_TIMEOUT
    )
    worker = Worker(spec, rank, store)
    with torch.inference_mode():
        while True:
            message = receive_object(worker.cpu_group)
            if message is None:
                return
            method, args = message
            getattr(worker, method)(*args)
