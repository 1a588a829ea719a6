"""Start-up sizing of the KV cache: a byte budget (the executor measures it on the device:
executor/memory.py) -> whole blocks, or a refusal that says what would fit.  The bytes come
from kv/spec.py, the same accounting the planner uses."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace

import torch

from kvserve.config import CacheConfig, format_bytes
from kvserve.errors import ParameterError
from kvserve.executor.memory import GIB, CapacityError, HostMemory, headroom_text
from kvserve.kv.spec import DTYPE_BITS, KVCacheSpec

logger = logging.getLogger("kvserve")
ALLOW_LONG_ENV = "KVSERVE_ALLOW_LONG_MAX_MODEL_LEN"


@dataclass(frozen=True)
class KVCacheSizing:
    spec: KVCacheSpec
    num_blocks: int
    max_model_len: int
    num_host_blocks: int = 0  # the host tier's (--kv-offloading-size)
    host_dtype: str | None = None  # the host tier's storage dtype (int8: compressed)
    num_disk_blocks: int = 0  # the disk tier's (--kv-offloading-dir-size), host-tier blocks

    @property
    def host_spec(self) -> KVCacheSpec:
        """The accounting of a host-tier block: the cache's, in the host tier's dtype."""
        return replace(self.spec, dtype=self.host_dtype or self.spec.dtype)

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.spec.block_size

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.spec.bytes_per_block

    @property
    def max_concurrency(self) -> float:
        """Sequences of max_model_len tokens that fit at once (whole blocks each, windows
        applied)."""
        return self.num_blocks / self.spec.num_blocks_for_tokens(self.max_model_len)

    def summary(self) -> str:
        spec, length = self.spec, self.max_model_len
        per_sequence = spec.bytes_per_sequence(length)
        return (
            f"KV cache: {self.num_blocks:,} blocks x {spec.block_size} tokens = "
            f"{self.num_tokens:,} tokens ({format_bytes(self.num_bytes)}, "
            f"{spec.bytes_per_token:,} bytes/token, {spec.dtype}); "
            f"{per_sequence:,} bytes per sequence of {length:,} tokens; "
            f"max concurrency at {length:,} tokens: {self.max_concurrency:.1f}x"
            + self._host_summary()
            + self._groups_summary()
        )

    def _groups_summary(self) -> str:
        """One line per KV cache group where the layers form several or one slides."""
        spec = self.spec
        if not any(g.window for g in spec.groups) and len(spec.groups) < 2:
            return ""
        per_layer = spec.bytes_per_token_per_layer
        lines = [
            f"\n  KV cache group {i}: {group.describe()}; "
            f"{len(group.layers) * per_layer:,} bytes/token, "
            f"{group.num_blocks_kept(self.max_model_len, spec.block_size):,} blocks per "
            f"sequence of {self.max_model_len:,} tokens"
            for i, group in enumerate(spec.groups)
        ]
        return "".join(lines)

    def _host_summary(self) -> str:
        if not self.num_host_blocks:
            return ""
        host = self.host_spec
        num_bytes = self.num_host_blocks * host.bytes_per_block
        return (
            f"; host tier: {self.num_host_blocks:,} blocks = "
            f"{self.num_host_blocks * host.block_size:,} tokens ({format_bytes(num_bytes)}"
            + (f", {host.dtype}" if host.dtype != self.spec.dtype else "")
            + ")"
            + (f"; disk tier: {self.num_disk_blocks:,} blocks" if self.num_disk_blocks else "")
        )


def resolve_max_model_len(requested: int | None, trained: int, allow_long: bool) -> int:
    """--max-model-len, or the model's trained context (max_position_embeddings) by default.

    Positions past the trained context were never seen in training (RoPE extrapolates badly),
    so a longer length is refused unless the caller accepts it: --allow-long-max-model-len or
    KVSERVE_ALLOW_LONG_MAX_MODEL_LEN=1 (vLLM: VLLM_ALLOW_LONG_MAX_MODEL_LEN), and then logged
    as a warning."""
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
    if requested > trained:
        logger.warning(
            "--max-model-len %d exceeds the model's trained context of %d tokens "
            "(allowed by the override): outputs past it may degrade", requested, trained,
        )  # fmt: skip
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


def refuse_features_of_groups(spec: KVCacheSpec, cache: CacheConfig) -> None:
    """ParameterError for a flag that several KV cache groups do not serve yet: KV events
    describe one table's blocks (vLLM's wire format has no group)."""
    several = len(spec.groups) > 1
    refused = [
        ("--kv-events-config", cache.kv_events is not None and several),
        ("--kv-offloading-dir", cache.kv_offloading_dir is not None and several),
    ]
    for flag, refuse in refused:
        if refuse:
            raise ParameterError(
                flag, "is not supported yet for a model with sliding-window layers "
                f"(its KV cache groups: {'; '.join(g.describe() for g in spec.groups)}); "
                "leave it out to serve this model",
            )  # fmt: skip


def host_tier_dtype(cache_dtype: str, compression: str | None, device: torch.device) -> str:
    """The host tier's storage dtype (--kv-offloading-compression): int8 codes + scales for a
    cache of full-precision rows (by default on a CPU: there the tier is the KV cache's own
    RAM, and only compressed does it hold more tokens per byte than the cache); the cache's
    dtype when asked for none or when the cache is quantized already (fp8, int8, int4)."""
    if compression is None:
        compression = "int8" if device.type == "cpu" else "none"
    if compression == "none" or DTYPE_BITS.get(cache_dtype, 8) <= 8:  # k8v4 too
        return cache_dtype
    return compression


def size_host_tier(
    sizing: KVCacheSizing,
    offloading_gib: float | None,
    device: torch.device,
    host: HostMemory,
    compression: str | None = "none",
) -> KVCacheSizing:
    """`sizing` with the host tier's whole blocks in --kv-offloading-size GiB (none when
    unset), stored as `compression` says (host_tier_dtype).  CapacityError when it would
    leave less than the headroom of host memory available (on a CPU the KV cache, not
    allocated yet, comes out of the same RAM), or when it holds not even one block."""
    if offloading_gib is None:
        return sizing
    host_dtype = host_tier_dtype(sizing.spec.dtype, compression, device)
    spec = replace(sizing.spec, dtype=host_dtype)
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
            f"{headroom_text(host)} of the {format_bytes(host.available)} of host memory "
            f"available now; at most {max(0, room) / GIB:.2f} GiB fits"
        )
    return replace(sizing, num_host_blocks=num_blocks, host_dtype=host_dtype)


def size_disk_tier(sizing: KVCacheSizing, dir_size: int, directory: str | None) -> KVCacheSizing:
    """`sizing` with the disk tier's whole host-tier blocks in --kv-offloading-dir-size
    bytes (the few hundred bytes of a file's header not counted); none without a directory."""
    if directory is None or not sizing.num_host_blocks:
        return sizing
    num_blocks = sizing.host_spec.num_blocks_in(dir_size)
    if num_blocks == 0:
        raise ParameterError(
            "--kv-offloading-dir-size",
            f"{format_bytes(dir_size)} holds no block of "
            f"{format_bytes(sizing.host_spec.bytes_per_block)}",
        )
    return replace(sizing, num_disk_blocks=num_blocks)
