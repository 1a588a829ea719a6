"""Start-up sizing of the KV cache: a byte budget -> whole blocks, or a refusal that says what
would fit.  The bytes come from kv/spec.py, the same accounting the planner uses."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvserve.config import CacheConfig, format_bytes
from kvserve.kv.spec import KVCacheSpec
from kvserve.runner import platform


class CapacityError(ValueError):
    """The KV cache cannot hold one sequence of max_model_len tokens."""


@dataclass(frozen=True)
class KVCacheSizing:
    spec: KVCacheSpec
    num_blocks: int
    max_model_len: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.spec.block_size

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.spec.bytes_per_block

    @property
    def max_concurrency(self) -> float:
        """Sequences of max_model_len tokens that fit at once (whole blocks each)."""
        return self.num_blocks / math.ceil(self.max_model_len / self.spec.block_size)

    def summary(self) -> str:
        return (
            f"KV cache: {self.num_blocks:,} blocks x {self.spec.block_size} tokens = "
            f"{self.num_tokens:,} tokens ({format_bytes(self.num_bytes)}, "
            f"{self.spec.bytes_per_token:,} bytes/token, {self.spec.dtype}); "
            f"max concurrency at {self.max_model_len:,} tokens: {self.max_concurrency:.1f}x"
        )


def kv_budget_bytes(
    cache: CacheConfig,
    device: torch.device,
    weights_bytes: int,
    profile_peak_activation_bytes: Callable[[], int],
) -> int:
    """Bytes for the KV cache.

    --kv-cache-memory wins.  On a GPU: utilization (default 0.9) x device memory - weights -
    the peak activation memory of a profiling forward pass.  On a CPU, whose RAM everything
    shares: min(4 GiB, 25% of available RAM) unless --gpu-memory-utilization is given, which
    then applies to host RAM."""
    if cache.kv_cache_memory is not None:
        return cache.kv_cache_memory
    if device.type == "cpu" and cache.gpu_memory_utilization is None:
        return min(platform.CPU_DEFAULT_KV_BYTES, platform.available_host_memory() // 4)
    util = cache.gpu_memory_utilization if cache.gpu_memory_utilization is not None else 0.9
    total = platform.total_device_memory(device)
    activations = profile_peak_activation_bytes() if device.type == "cuda" else 0
    budget = int(util * total) - weights_bytes - activations
    if budget <= 0:
        raise CapacityError(
            f"no memory left for the KV cache: {util:.2f} x {format_bytes(total)} - weights "
            f"{format_bytes(weights_bytes)} - activations {format_bytes(activations)} <= 0; "
            "raise --gpu-memory-utilization or set --kv-cache-memory"
        )
    return budget


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
