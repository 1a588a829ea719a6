"""How many bytes the KV cache may take on this rank's device, measured after its weights are
loaded: a CPU's free RAM less a headroom, or a GPU's share less the weights, the profiled
activation peak, the CUDA graph pool and the memory outside PyTorch (vLLM's accounting).  The
engine turns the bytes into blocks (engine/sizing.py)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvserve.config import GPU_MEMORY_UTILIZATION_DEFAULT, CacheConfig, format_bytes
from kvserve.errors import UserInputError
from kvserve.native import platform

logger = logging.getLogger("kvserve")
GIB = 1024**3
MIB = 1024**2


class CapacityError(UserInputError):
    """The KV cache cannot hold one sequence of max_model_len tokens, or leaves the host short."""


@dataclass(frozen=True)
class HostMemory:
    """Host RAM measured after the weights are loaded, so `available` already excludes them."""

    total: int
    available: int

    @property
    def headroom(self) -> int:
        """What must stay available once the KV cache is allocated, for the OS, the page cache
        and this process's own growth (activations, tokenizer, HTTP buffers):
        max(1 GiB, 10% of RAM)."""
        return max(GIB, self.total // 10)

    @property
    def max_kv_bytes(self) -> int:
        """The largest KV cache that leaves the headroom (may be <= 0)."""
        return self.available - self.headroom


def measure_host_memory() -> HostMemory:
    return HostMemory(platform.total_host_memory(), platform.available_host_memory())


@dataclass(frozen=True)
class GpuMemoryBudget:
    """vLLM's start-up accounting of a GPU: of `utilization` x `total` device memory, what
    the weights, the activation peak of a profiling forward pass, the CUDA graph pool and
    the memory outside PyTorch's allocator (CUDA context, cuBLAS/NCCL workspaces, other
    processes) take; the rest is the KV cache's."""

    total: int
    utilization: float
    weights: int
    activations: int  # peak of one forward over max_num_batched_tokens prompt tokens
    cuda_graphs: int  # the captured decode graphs' private pool (0 when eager)
    non_torch: int  # device memory in use that PyTorch's caching allocator does not hold

    @property
    def requested(self) -> int:
        return int(self.utilization * self.total)

    @property
    def kv_cache(self) -> int:
        return self.requested - self.weights - self.activations - self.cuda_graphs - self.non_torch

    def summary(self) -> str:
        """One start-up log line naming each part."""
        parts = (
            ("weights", self.weights), ("activation peak (profiled)", self.activations),
            ("CUDA graph pool", self.cuda_graphs), ("non-torch memory", self.non_torch),
        )  # fmt: skip
        named = ", ".join(f"{name} {format_bytes(num)}" for name, num in parts)
        return (
            f"GPU memory: {self.utilization:.2f} x {format_bytes(self.total)} = "
            f"{format_bytes(self.requested)}, less {named} = KV cache {format_bytes(self.kv_cache)}"
        )


def kv_budget_bytes(
    cache: CacheConfig,
    device: torch.device,
    weights_bytes: int,
    profile_peak_activation_bytes: Callable[[], int],
    cuda_graph_pool_bytes: Callable[[], int] = lambda: 0,
) -> int:
    """Bytes for the KV cache.  Call after the weights are loaded (a CPU measures free RAM).

    --kv-cache-memory wins.  On a GPU: GpuMemoryBudget, logged part by part (each callable
    profiles on the device; the non-torch memory is measured after them).  On a CPU:
    cpu_kv_budget_bytes."""
    if device.type == "cpu":
        return cpu_kv_budget_bytes(cache, weights_bytes, measure_host_memory())
    if cache.kv_cache_memory is not None:
        return cache.kv_cache_memory
    util = cache.gpu_memory_utilization
    if util is None:
        util = GPU_MEMORY_UTILIZATION_DEFAULT
    activations = profile_peak_activation_bytes()
    graphs = cuda_graph_pool_bytes()
    budget = GpuMemoryBudget(
        total=platform.total_device_memory(device), utilization=util, weights=weights_bytes,
        activations=activations, cuda_graphs=graphs,
        non_torch=platform.non_torch_device_memory(device),
    )  # fmt: skip
    logger.info(budget.summary())
    if budget.kv_cache <= 0:
        raise CapacityError(
            f"no memory left for the KV cache: {budget.summary()}; raise "
            "--gpu-memory-utilization, set --kv-cache-memory, or --enforce-eager (no CUDA "
            "graph pool)"
        )
    return budget.kv_cache


def cpu_kv_budget_bytes(cache: CacheConfig, weights_bytes: int, host: HostMemory) -> int:
    """The KV cache in host RAM, which the OS and every other process share.

    --kv-cache-memory as given; --gpu-memory-utilization U: U x what was available before the
    weights (available now + weights) - weights, so U covers weights + KV as on a GPU;
    neither: min(4 GiB, 25% of available).  CapacityError when a requested budget would leave
    less than `host.headroom` available (the message names the largest safe values); the
    default is clipped to the safe size instead."""
    if host.max_kv_bytes < MIB:
        raise CapacityError(
            f"no room for a KV cache: host memory has {format_bytes(host.available)} available "
            f"and {headroom_text(host)} must stay free; free some memory first"
        )
    if cache.kv_cache_memory is not None:
        budget = cache.kv_cache_memory
        asked = f"--kv-cache-memory {format_bytes(budget)}"
    elif cache.gpu_memory_utilization is not None:
        util = cache.gpu_memory_utilization
        budget = int(util * (host.available + weights_bytes)) - weights_bytes
        asked = (
            f"--gpu-memory-utilization {util:.2f} ({util:.2f} x ({format_bytes(host.available)} "
            f"available + {format_bytes(weights_bytes)} weights) - weights = "
            f"{format_bytes(budget)} of KV cache)"
        )
    else:
        return min(platform.CPU_DEFAULT_KV_BYTES, host.available // 4, host.max_kv_bytes)
    safe = _safe_flags(weights_bytes, host)
    if budget > host.max_kv_bytes:
        raise CapacityError(
            f"{asked} would leave less than {headroom_text(host)} of the "
            f"{format_bytes(host.available)} of host memory available now; {safe}"
        )
    if budget <= 0:
        raise CapacityError(f"{asked} leaves no memory for the KV cache; raise it: {safe}")
    return budget


def headroom_text(host: HostMemory) -> str:
    return (
        f"{format_bytes(host.headroom)} (max(1 GiB, 10% of {format_bytes(host.total)} RAM), "
        "for the OS and this process)"
    )


def _safe_flags(weights_bytes: int, host: HostMemory) -> str:
    """The largest safe values of both flags, rounded down to values the CLI parses."""
    kv_mib = host.max_kv_bytes // MIB
    util = math.floor(100 * (host.max_kv_bytes + weights_bytes) / (host.available + weights_bytes))
    return (
        f"the largest safe values are --kv-cache-memory {kv_mib}MiB or "
        f"--gpu-memory-utilization {util / 100:.2f}"
    )
