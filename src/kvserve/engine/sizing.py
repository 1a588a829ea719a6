"""Start-up sizing of the KV cache: a byte budget -> whole blocks, or a refusal that says what
would fit.  The bytes come from kv/spec.py, the same accounting the planner uses."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from kvserve.config import GPU_MEMORY_UTILIZATION_DEFAULT, CacheConfig, format_bytes
from kvserve.errors import ParameterError, UserInputError
from kvserve.kv.spec import KVCacheSpec, cdiv
from kvserve.native import platform


class CapacityError(UserInputError):
    """The KV cache cannot hold one sequence of max_model_len tokens."""


@dataclass(frozen=True)
class KVCacheSizing:
    spec: KVCacheSpec
    num_blocks: int
    max_model_len: int
    num_host_blocks: int = 0  # the host tier's (--kv-offloading-size)

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.spec.block_size

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.spec.bytes_per_block

    @property
    def max_concurrency(self) -> float:
        """Sequences of max_model_len tokens that fit at once (whole blocks each)."""
        return self.num_blocks / cdiv(self.max_model_len, self.spec.block_size)

    def summary(self) -> str:
        return (
            f"KV cache: {self.num_blocks:,} blocks x {self.spec.block_size} tokens = "
            f"{self.num_tokens:,} tokens ({format_bytes(self.num_bytes)}, "
            f"{self.spec.bytes_per_token:,} bytes/token, {self.spec.dtype}); "
            f"max concurrency at {self.max_model_len:,} tokens: {self.max_concurrency:.1f}x"
            + self._host_summary()
        )

    def _host_summary(self) -> str:
        if not self.num_host_blocks:
            return ""
        num_bytes = self.num_host_blocks * self.spec.bytes_per_block
        return (
            f"; host tier: {self.num_host_blocks:,} blocks = "
            f"{self.num_host_blocks * self.spec.block_size:,} tokens ({format_bytes(num_bytes)})"
        )


logger = logging.getLogger("kvserve")
GIB = 1024**3
MIB = 1024**2
ALLOW_LONG_ENV = "KVSERVE_ALLOW_LONG_MAX_MODEL_LEN"


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
            f"and {_headroom_text(host)} must stay free; free some memory first"
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
            f"{asked} would leave less than {_headroom_text(host)} of the "
            f"{format_bytes(host.available)} of host memory available now; {safe}"
        )
    if budget <= 0:
        raise CapacityError(f"{asked} leaves no memory for the KV cache; raise it: {safe}")
    return budget


def _headroom_text(host: HostMemory) -> str:
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


def resolve_max_model_len(requested: int | None, trained: int, allow_long: bool) -> int:
    """--max-model-len, or the model's trained context (max_position_embeddings) by default.

    Positions past the trained context were never seen in training (RoPE extrapolates badly),
    so a longer length is refused unless the caller accepts it: --allow-long-max-model-len or
    KVSERVE_ALLOW_LONG_MAX_MODEL_LEN=1 (vLLM: VLLM_ALLOW_LONG_MAX_MODEL_LEN)."""
    if requested is None:
        return trained
    if requested > trained and not (allow_long or _env_flag(ALLOW_LONG_ENV)):
        raise ParameterError(
            "--max-model-len",
            f"{requested} exceeds the model's trained context of {trained:,} "
            "tokens (max_position_embeddings): positions beyond it were never trained and "
            f"outputs degrade. Use --max-model-len {trained} or less, or accept it with "
            f"--allow-long-max-model-len (or {ALLOW_LONG_ENV}=1)",
        )
    return requested


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes")


def size_kv_cache(spec: KVCacheSpec, budget_bytes: int, max_model_len: int) -> KVCacheSizing:
    """Whole blocks in the budget; CapacityError when one max_model_len sequence won't fit."""
    num_blocks = spec.num_blocks_in(budget_bytes)
    needed = spec.num_blocks_for_tokens(max_model_len)
    if num_blocks < needed:
        fits = num_blocks * spec.block_size
        raise CapacityError(
            f"the KV cache ({format_bytes(budget_bytes)} = {num_blocks} blocks = {fits:,} tokens "
            f"at {spec.bytes_per_token:,} bytes/token) cannot hold one sequence of "
            f"max_model_len {max_model_len:,} tokens (needs {needed} blocks, "
            f"{format_bytes(needed * spec.bytes_per_block)}). The largest max_model_len that "
            f"fits is {fits:,}: pass --max-model-len {fits}, or raise --kv-cache-memory / "
            "--gpu-memory-utilization, or use --kv-cache-dtype fp8 or int8"
        )
    return KVCacheSizing(spec, num_blocks, max_model_len)


def size_host_tier(
    sizing: KVCacheSizing, offloading_gib: float | None, device: torch.device, host: HostMemory
) -> KVCacheSizing:
    """`sizing` with the host tier's whole blocks in --kv-offloading-size GiB (none when
    unset).  CapacityError when it would leave less than the headroom of host memory
    available (on a CPU the KV cache, not allocated yet, comes out of the same RAM), or when
    it holds not even one block."""
    if offloading_gib is None:
        return sizing
    spec = sizing.spec
    num_bytes = int(offloading_gib * GIB)
    num_blocks = spec.num_blocks_in(num_bytes)
    if num_blocks == 0:
        raise ParameterError(
            "--kv-offloading-size",
            f"{offloading_gib} GiB holds no block of {format_bytes(spec.bytes_per_block)}",
        )
    room = host.max_kv_bytes - (sizing.num_bytes if device.type == "cpu" else 0)
    if num_blocks * spec.bytes_per_block > room:
        raise CapacityError(
            f"--kv-offloading-size {offloading_gib} GiB would leave less than "
            f"{_headroom_text(host)} of the {format_bytes(host.available)} of host memory "
            f"available now; at most {max(0, room) / GIB:.2f} GiB fits"
        )
    return replace(sizing, num_host_blocks=num_blocks)
