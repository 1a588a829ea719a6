"""The Worker: one rank's model, KV caches and runner, the same code for one rank and for N (a
shard of one is the whole model).  An executor makes one per rank and calls each, on every
rank in the same order (any call may run collectives):

    Worker(spec, rank)       device and dtype, the checkpoint, this rank's model, the backend
    join(store)              N > 1 only: the process groups (executor/collective.py)
    calibrate_key_offsets    a 4-bit cache's key offsets, measured on the canary
    check_kv_cache_dtype     a quantized KV dtype against a canary (executor/kv_dtype_check.py)
    plan_cuda_graphs         which decode graphs to capture (runner/cuda_graphs.py)
    profile_*                the activation peak and the graph pool, for the KV sizing (GPU)
    initialize_kv_caches     the device and host caches, and the runner over them
    warm_up                  the layers' path (executor/layer_kernels.py), then the graphs
    execute                  every step

What N ranks do not run, and why, is decided in one place: executor/base.py
NOT_WITH_TENSOR_PARALLEL.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from kvserve.attention import select_backend
from kvserve.attention.kv_cache import LayerKVCache, allocate_kv_caches, kv_cache_bytes
from kvserve.config import CacheConfig, LoadConfig, ModelConfig
from kvserve.errors import ParameterError
from kvserve.executor.base import WorkerSpec, bind_compute_threads, tensor_parallel_refuses
from kvserve.executor.collective import STORE_TIMEOUT, make_process_group, receive_object
from kvserve.executor.disk_reads import DiskReadsOfEveryRank
from kvserve.executor.kv_dtype_check import Canary, check_kv_cache_dtype
from kvserve.executor.kv_shards import gather_heads
from kvserve.executor.layer_kernels import choose_layer_kernels
from kvserve.kv.spec import KVCacheSpec
from kvserve.models.loader import Checkpoint, load_checkpoint
from kvserve.models.parallel import RankShard, TPGroup, build_sharded_model, shard_plan
from kvserve.models.quantized_linear import q8_plan
from kvserve.models.registry import get_model_class
from kvserve.native import platform
from kvserve.runner.cuda_graphs import GraphPlan, decode_graph_plan, profile_graph_pool_bytes
from kvserve.runner.disk_tier import DiskBlocks
from kvserve.runner.key_offsets import calibrate_key_offsets
from kvserve.runner.model_runner import ModelRunner, profile_peak_activation_bytes
from kvserve.step import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger("kvserve")
CPU = torch.device("cpu")


def resolve_placement(load: LoadConfig, config: ModelConfig) -> tuple[torch.device, str]:
    """--device and --dtype (its name) as this machine resolves them: rank 0's, which the
    other ranks are told, so that every rank computes in the same dtype."""
    device = platform.resolve_device(load.device)
    dtype = platform.resolve_dtype(load.dtype, device, config.torch_dtype)
    return device, platform.dtype_name(dtype)


def rank_device(device: str, rank: int, world_size: int) -> torch.device:
    """The one rank's device as resolved; with N ranks a CPU for every rank, or rank r's GPU
    (a Ray actor sees only its own GPU, as cuda:0)."""
    if world_size == 1 or not device.startswith("cuda"):
        return torch.device(device)
    return torch.device("cuda", rank % torch.cuda.device_count())


def build_model(
    checkpoint: Checkpoint, shard: RankShard, group: TPGroup, dtype: torch.dtype,
    device: torch.device, weight_dtype: str = "float",
) -> torch.nn.Module:  # fmt: skip
    """This rank's model: the whole model for a shard of one (its weights as --weight-dtype
    says), else its slices joined to the group (models/parallel.py), in float weights."""
    model_cls = get_model_class(checkpoint.config.architecture)
    if shard.world_size == 1:
        q8 = q8_plan(weight_dtype, device, dtype, checkpoint.config.stored_weight_type)
        if q8 is not None:
            logger.info("int%d weights for steps of up to %s rows%s", q8.bits, q8.kernel_rows,
                        " (float weights kept above)" if q8.keep_float else "")  # fmt: skip
        return model_cls.from_weights(checkpoint.config, checkpoint.weights, dtype, device, q8)
    return build_sharded_model(
        model_cls, checkpoint.config, checkpoint.weights, shard, group, dtype, device
    )


class Worker:
    def __init__(self, spec: WorkerSpec, rank: int, checkpoint: Checkpoint | None = None) -> None:
        """Loads the checkpoint unless given one (whose weights it then drops) and builds this
        rank's model.  ParameterError for a tensor-parallel size the heads refuse."""
        self.spec, self.rank, self.world_size = spec, rank, spec.world_size
        load = spec.config.load
        self.device = rank_device(spec.device, rank, self.world_size)
        self.dtype = getattr(torch, spec.dtype)
        checkpoint = checkpoint or load_checkpoint(load.model)
        self.model_config, self.model_name = checkpoint.config, checkpoint.name
        self.model_path: Path = checkpoint.path
        self.shards = shard_plan(checkpoint.config, self.world_size)  # every rank's
        self.shard = self.shards[rank]
        self.device_group = TPGroup(None, rank, self.world_size)  # joined in `join`
        self.cpu_group = self.device_group
        self.model = build_model(checkpoint, self.shard, self.device_group, self.dtype,
                                 self.device, load.weight_dtype)  # fmt: skip
        del checkpoint.weights
        self.backend = select_backend(load.attention_backend, self.device)
        self.graph_plan: GraphPlan | None = None
        self.kv_caches: list[LayerKVCache] = []
        self.num_blocks = 0
        self.runner: ModelRunner | None = None
        self.disk_reads: DiskReadsOfEveryRank | None = None  # N ranks with a disk tier

    def join(self, store: dist.Store, before_join: Callable[[], None] | None = None) -> None:
        """N > 1: say this rank is built, wait (`before_join`: rank 0 waits for every rank),
        then create the process groups that the model's collectives and the calls use."""
        rank, size = self.rank, self.world_size
        store.set(f"ready/{rank}", "1")
        if before_join is not None:
            before_join()
        backend = self.spec.group_backend
        self.device_group.process_group = make_process_group(store, "device", backend, rank, size)
        if backend != "gloo":
            self.cpu_group = TPGroup(make_process_group(store, "cpu", "gloo", rank, size),
                                     rank, size)  # fmt: skip

    # ------------------------------------------------------------------ before the sizing
    def calibrate_key_offsets(self, canary_token_ids: list[int]) -> None:
        """Each layer's key offset for a 4-bit cache (runner/key_offsets.py)."""
        calibrate_key_offsets(self.model, canary_token_ids, self.device)

    def check_kv_cache_dtype(
        self, cache: CacheConfig, canary_token_ids: list[int]
    ) -> str | ParameterError:
        """The KV dtype the start-up check settles on (executor/kv_dtype_check.py), or its
        refusal, returned rather than raised: every rank reaches the same verdict, and one
        that raised would leave the ranks' loop (the executor raises rank 0's)."""
        try:
            return check_kv_cache_dtype(
                cache,
                lambda: Canary(self.model, self.model.config, canary_token_ids, self.dtype,
                               cache.block_size, self.device),
            )  # fmt: skip
        except ParameterError as refusal:
            return refusal

    def plan_cuda_graphs(self, max_num_seqs: int, max_model_len: int, block_size: int) -> None:
        load = self.spec.config.load
        plan = decode_graph_plan(self.device, load.enforce_eager, self.backend, max_num_seqs,
                                 max_model_len, block_size)  # fmt: skip
        if plan is not None and tensor_parallel_refuses("CUDA graphs", self.world_size):
            plan = None
        self.graph_plan = plan

    def local_spec(self, spec: KVCacheSpec) -> KVCacheSpec:
        """The engine's spec (sized for the largest share) with this rank's KV heads."""
        return replace(spec, num_kv_heads=len(self.shard.kv_heads))

    def profile_peak_activation_bytes(self, spec: KVCacheSpec, num_tokens: int) -> int:
        """One sequence's prefill through caches of the plain layout (a table of every block:
        the peak is the activations')."""
        plain = replace(self.local_spec(spec), groups=())
        return profile_peak_activation_bytes(
            self.model, plain, num_tokens, self.backend, self.device
        )

    def profile_graph_pool_bytes(self, spec: KVCacheSpec) -> int:
        if self.graph_plan is None:
            return 0
        return profile_graph_pool_bytes(
            self.model, replace(self.local_spec(spec), groups=()), self.backend, self.device,
            self.graph_plan,
        )  # fmt: skip

    def weight_bytes(self) -> int:
        """This rank's parameters and buffers (packed weights included)."""
        tensors = list(self.model.parameters()) + list(self.model.buffers())
        return sum(t.numel() * t.element_size() for t in tensors)

    # ------------------------------------------------------------------ caches and steps
    def initialize_kv_caches(
        self,
        spec: KVCacheSpec,
        num_blocks: int,
        num_host: int,
        host_dtype: str | None = None,
        disk_dir: str | None = None,
    ) -> None:
        """`num_blocks` device blocks for this rank's KV heads (one more with CUDA graphs: the
        pad rows' scratch block), `num_host` of the --kv-offloading-size host tier in
        `host_dtype` (None: the cache's), the disk tier's files below it in `disk_dir` (a
        file per block and rank); the block ids are every rank's."""
        local = self.local_spec(spec)
        num_pad_blocks = 0 if self.graph_plan is None else 1
        self.num_blocks = num_blocks
        self.kv_caches = allocate_kv_caches(local, num_blocks + num_pad_blocks, self.device)
        host_kv_caches = (
            allocate_kv_caches(replace(local, dtype=host_dtype or local.dtype), num_host, CPU,
                               pin_memory=self.device.type == "cuda")
            if num_host else None
        )  # fmt: skip
        disk_blocks = self._disk_blocks(disk_dir, host_kv_caches)
        self.runner = ModelRunner(
            self.model, self.kv_caches, self.backend, spec.block_size, self.device,
            seed=self.spec.config.load.seed, host_kv_caches=host_kv_caches,
            layer_groups=layer_groups(spec), disk_blocks=disk_blocks,
        )  # fmt: skip
        if disk_blocks is not None and self.world_size > 1:
            self.disk_reads = DiskReadsOfEveryRank(self.cpu_group)

    def _disk_blocks(
        self, disk_dir: str | None, host_kv_caches: list[LayerKVCache] | None
    ) -> DiskBlocks | None:
        if disk_dir is None or host_kv_caches is None:
            return None
        return DiskBlocks(Path(disk_dir), host_kv_caches, self.rank)

    def kv_cache_bytes(self) -> int:
        return kv_cache_bytes(self.kv_caches)

    def warm_up(self) -> None:
        """The layers' fastest path that serves them (its warm-up writes into the first blocks:
        before any cached block is loaded), then the decode graphs (after a compile: they
        record the compiled kernels)."""
        assert self.runner is not None, "initialize_kv_caches first"
        choose_layer_kernels(self.model, self.runner.warm_up, self.spec.config.load.enforce_eager,
                             self.world_size, self._on_every_rank)  # fmt: skip
        if self.graph_plan is not None and not self.runner.layer_groups:
            self.runner.capture_cuda_graphs(self.graph_plan, pad_block_id=self.num_blocks)

    def _on_every_rank(self, ok: bool) -> bool:
        """Whether `ok` holds on every rank (a collective: every rank asks at once)."""
        if self.world_size == 1:
            return ok
        num_failed = self.cpu_group.all_reduce(torch.tensor([0 if ok else 1]))
        return int(num_failed) == 0

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        assert self.runner is not None, "initialize_kv_caches first"
        result = self.runner.execute(output)
        return result if self.disk_reads is None else self.disk_reads.agree(output, result)

    # ------------------------------------------------------------------ the prefix store's rows
    def gather_kv_rows(self, layer: int, name: str, block_ids: torch.Tensor) -> torch.Tensor:
        """Blocks' rows of one table with every rank's KV heads (executor/kv_shards.py; a
        collective: every rank calls it, rank 0's result is used)."""
        table = getattr(self.kv_caches[layer], name)
        rows = table.index_select(0, block_ids.to(self.device))
        heads = [list(shard.kv_heads) for shard in self.shards]
        return gather_heads(rows, heads, self.device_group.all_gather).cpu()

    def scatter_kv_rows(
        self, layer: int, name: str, block_ids: torch.Tensor, rows: torch.Tensor
    ) -> None:
        """Write blocks' rows of one table given with every KV head: this rank's heads."""
        table = getattr(self.kv_caches[layer], name)
        mine = rows[:, :, list(self.shard.kv_heads)]
        table[block_ids.to(self.device)] = mine.to(device=self.device, dtype=table.dtype)


def layer_groups(spec: KVCacheSpec) -> list[int]:
    """Each layer's KV cache group (empty without groups)."""
    groups = [0] * spec.num_layers
    for index, group in enumerate(spec.groups):
        for layer in group.layers:
            groups[layer] = index
    return groups if spec.groups else []


def run_worker(spec: WorkerSpec, rank: int) -> None:
    """A rank > 0 from start to end: build, join, then follow rank 0's calls until None."""
    cpu_plan = spec.cpu_plans[rank]
    if cpu_plan is not None:  # this process's main thread runs the steps: its team
        torch.set_num_threads(len(cpu_plan.compute_cpus))
        bind_compute_threads(cpu_plan)
    store = dist.TCPStore(
        spec.store_host, spec.store_port, spec.world_size, False, timeout=STORE_TIMEOUT
    )
    worker = Worker(spec, rank)
    worker.join(store)
    with torch.inference_mode():
        while True:
            message = receive_object(worker.cpu_group)
            if message is None:
                return
            method, args = message
            getattr(worker, method)(*args)
