"""Start-up sizing without a model: the KV budget on a CPU from measured host memory (exact
numbers), the refusals that name the largest safe values, the GPU formula, the trained-context
check of --max-model-len, and the host memory figures (cgroup limits included)."""

from __future__ import annotations

import pytest
import torch

from kvserve.config import CacheConfig
from kvserve.engine import sizing
from kvserve.engine.sizing import resolve_max_model_len
from kvserve.errors import ParameterError
from kvserve.executor import memory
from kvserve.executor.memory import (
    GIB,
    MIB,
    CapacityError,
    HostMemory,
    cpu_kv_budget_bytes,
    kv_budget_bytes,
)
from kvserve.kv.spec import kv_cache_spec
from kvserve.native import platform

# 20 GiB of RAM: the headroom is 10% = 2 GiB.  12 GiB available after 2 GiB of weights, so the
# largest safe KV cache is 12 - 2 = 10 GiB, and --gpu-memory-utilization U asks for
# U x (12 + 2) GiB - 2 GiB.
HOST = HostMemory(total=20 * GIB, available=12 * GIB)
WEIGHTS = 2 * GIB


def budget(host: HostMemory = HOST, **cache) -> int:
    return cpu_kv_budget_bytes(CacheConfig(**cache), WEIGHTS, host)


def test_headroom_is_ten_percent_of_ram_but_at_least_one_gib():
    assert HOST.headroom == 2 * GIB and HOST.max_kv_bytes == 10 * GIB
    assert HostMemory(total=4 * GIB, available=3 * GIB).headroom == GIB


def test_utilization_is_a_fraction_of_the_memory_available_before_the_weights():
    assert budget(gpu_memory_utilization=0.5) == 7 * GIB - WEIGHTS == 5 * GIB
    assert budget(gpu_memory_utilization=0.85) == int(0.85 * 14 * GIB) - WEIGHTS


def test_kv_cache_memory_is_taken_as_given_up_to_the_safe_size():
    assert budget(kv_cache_memory=512 * MIB) == 512 * MIB
    assert budget(kv_cache_memory=10 * GIB) == 10 * GIB


def test_default_is_min_of_4gib_and_a_quarter_of_available_clipped_to_safe():
    assert budget() == 3 * GIB  # 12 GiB / 4
    assert budget(HostMemory(total=64 * GIB, available=60 * GIB)) == 4 * GIB
    tight = HostMemory(total=20 * GIB, available=2 * GIB + 512 * MIB)
    assert budget(tight) == 512 * MIB  # a quarter would be 640 MiB


def test_a_utilization_past_the_headroom_is_refused_naming_the_largest_safe_values():
    # 0.9 x 14 GiB - 2 GiB = 10.6 GiB > 10 GiB; safe U = (10 + 2) / 14 = 0.857 -> 0.85.
    with pytest.raises(CapacityError) as err:
        budget(gpu_memory_utilization=0.9)
    msg = str(err.value)
    assert msg.startswith("--gpu-memory-utilization 0.90 (0.90 x (12.0 GiB available + 2.0 GiB")
    assert "would leave less than 2.0 GiB (max(1 GiB, 10% of 20.0 GiB RAM)" in msg
    assert msg.endswith(
        "the largest safe values are --kv-cache-memory 10240MiB or --gpu-memory-utilization 0.85"
    )
    assert budget(gpu_memory_utilization=0.85) <= HOST.max_kv_bytes  # the named value starts


def test_a_kv_cache_memory_past_the_headroom_is_refused_too():
    with pytest.raises(CapacityError, match="--kv-cache-memory 10240MiB or") as err:
        budget(kv_cache_memory=10 * GIB + 1)
    assert str(err.value).startswith("--kv-cache-memory 10.0 GiB would leave less than 2.0 GiB")


def test_a_utilization_below_the_weights_is_refused():
    with pytest.raises(CapacityError, match="leaves no memory for the KV cache; raise it"):
        budget(gpu_memory_utilization=0.1)  # 1.4 GiB < 2 GiB of weights


def test_no_room_at_all_is_refused_whatever_the_flags():
    full = HostMemory(total=20 * GIB, available=2 * GIB + MIB // 2)
    for cache in ({}, {"kv_cache_memory": MIB}):
        with pytest.raises(CapacityError, match="no room for a KV cache: host memory has"):
            budget(full, **cache)


def test_kv_budget_bytes_measures_the_host_on_a_cpu(monkeypatch):
    monkeypatch.setattr(platform, "total_host_memory", lambda: 20 * GIB)
    monkeypatch.setattr(platform, "available_host_memory", lambda: 12 * GIB)
    cache = CacheConfig(gpu_memory_utilization=0.5)
    never = lambda: pytest.fail("a CPU does not profile activations")  # noqa: E731
    assert kv_budget_bytes(cache, torch.device("cpu"), WEIGHTS, never) == 5 * GIB
    assert memory.measure_host_memory() == HOST


def test_gpu_budget_is_utilization_of_device_memory_less_weights_and_activations(monkeypatch):
    monkeypatch.setattr(platform, "total_device_memory", lambda device: 80 * GIB)
    monkeypatch.setattr(platform, "non_torch_device_memory", lambda device: 0)
    cuda = torch.device("cuda")
    got = kv_budget_bytes(CacheConfig(), cuda, 16 * GIB, lambda: GIB)
    assert got == int(0.9 * 80 * GIB) - 17 * GIB
    with pytest.raises(CapacityError, match="no memory left for the KV cache"):
        kv_budget_bytes(CacheConfig(gpu_memory_utilization=0.1), cuda, 16 * GIB, lambda: GIB)


def test_gpu_budget_subtracts_the_cuda_graph_pool_and_non_torch_memory_and_logs_each(
    monkeypatch, caplog
):
    monkeypatch.setattr(platform, "total_device_memory", lambda device: 80 * GIB)
    monkeypatch.setattr(platform, "non_torch_device_memory", lambda device: 512 * MIB)
    cuda = torch.device("cuda")
    with caplog.at_level("INFO", logger="kvserve"):
        got = kv_budget_bytes(
            CacheConfig(gpu_memory_utilization=0.5), cuda, 16 * GIB, lambda: 3 * GIB,
            cuda_graph_pool_bytes=lambda: 256 * MIB,
        )  # fmt: skip
    assert got == 40 * GIB - 16 * GIB - 3 * GIB - 256 * MIB - 512 * MIB == 20 * GIB + 256 * MIB
    assert caplog.messages == [
        "GPU memory: 0.50 x 80.0 GiB = 40.0 GiB, less weights 16.0 GiB, activation peak "
        "(profiled) 3.0 GiB, CUDA graph pool 256.0 MiB, non-torch memory 512.0 MiB = "
        "KV cache 20.2 GiB"
    ]


def test_gpu_budget_arithmetic():
    budget = memory.GpuMemoryBudget(
        total=141 * GIB, utilization=0.9, weights=15 * GIB, activations=2 * GIB,
        cuda_graphs=GIB, non_torch=GIB,
    )  # fmt: skip
    assert budget.requested == int(0.9 * 141 * GIB)
    assert budget.kv_cache == int(0.9 * 141 * GIB) - 19 * GIB


def test_kv_cache_memory_skips_every_profile_on_a_gpu():
    never = lambda: pytest.fail("--kv-cache-memory needs no profile")  # noqa: E731
    cache = CacheConfig(kv_cache_memory=5 * GIB)
    assert kv_budget_bytes(cache, torch.device("cuda"), GIB, never, never) == 5 * GIB


# ---------------------------------------------------------------- the host tier
SPEC = kv_cache_spec(2, 2, 16, "auto", "float32", 16)  # 8 KiB a block


def test_host_tier_blocks_are_whole_blocks_of_the_gib_given():
    base = sizing.KVCacheSizing(SPEC, num_blocks=12, max_model_len=192)
    assert sizing.size_host_tier(base, None, torch.device("cpu"), HOST) is base
    sized = sizing.size_host_tier(base, 1.0, torch.device("cuda"), HOST)
    assert sized.num_host_blocks == GIB // (8 * 1024) == 131072
    assert sized.summary().endswith("; host tier: 131,072 blocks = 2,097,152 tokens (1.0 GiB)")
    with pytest.raises(ParameterError, match="holds no block"):
        sizing.size_host_tier(base, 2**-20, torch.device("cpu"), HOST)


def test_a_host_tier_past_the_headroom_is_refused_counting_a_cpu_kv_cache():
    # 10 GiB may be taken from host memory; on a CPU a 4 GiB KV cache takes its share.
    big = sizing.KVCacheSizing(SPEC, num_blocks=4 * GIB // (8 * 1024), max_model_len=192)
    assert sizing.size_host_tier(big, 10.0, torch.device("cuda"), HOST).num_host_blocks > 0
    with pytest.raises(CapacityError, match="at most 6.00 GiB fits"):
        sizing.size_host_tier(big, 7.0, torch.device("cpu"), HOST)


# ---------------------------------------------------------------- --max-model-len
def test_max_model_len_defaults_to_the_trained_context_and_may_be_shorter():
    assert resolve_max_model_len(None, 8192, allow_long=False) == 8192
    assert resolve_max_model_len(2048, 8192, allow_long=False) == 2048
    assert resolve_max_model_len(8192, 8192, allow_long=False) == 8192


def test_max_model_len_beyond_the_trained_context_needs_the_override(monkeypatch):
    monkeypatch.delenv(sizing.ALLOW_LONG_ENV, raising=False)
    with pytest.raises(ValueError) as err:
        resolve_max_model_len(32768, 8192, allow_long=False)
    msg = str(err.value)
    assert msg.startswith("--max-model-len 32768 exceeds the model's trained context of 8,192")
    assert "Use --max-model-len 8192 or less" in msg
    assert "--allow-long-max-model-len (or KVSERVE_ALLOW_LONG_MAX_MODEL_LEN=1)" in msg
    assert resolve_max_model_len(32768, 8192, allow_long=True) == 32768
    monkeypatch.setenv(sizing.ALLOW_LONG_ENV, "1")
    assert resolve_max_model_len(32768, 8192, allow_long=False) == 32768
    monkeypatch.setenv(sizing.ALLOW_LONG_ENV, "0")
    with pytest.raises(ValueError, match="exceeds the model's trained context"):
        resolve_max_model_len(32768, 8192, allow_long=False)


# ---------------------------------------------------------------- host memory figures
def test_cgroup_files_are_read_as_bytes_or_none(tmp_path):
    (tmp_path / "memory.max").write_text("max\n")
    (tmp_path / "memory.current").write_text("1073741824\n")
    assert platform._read_cgroup_bytes("memory.max", str(tmp_path)) is None
    assert platform._read_cgroup_bytes("memory.current", str(tmp_path)) == GIB
    assert platform._read_cgroup_bytes("absent", str(tmp_path)) is None


def test_a_cgroup_limit_caps_available_and_total_memory(monkeypatch):
    """Inside a container /proc/meminfo shows the host; the cgroup limit is what counts."""
    files = {"memory.max": 8 * GIB, "memory.current": 3 * GIB}
    monkeypatch.setattr(platform, "_read_cgroup_bytes", lambda name: files.get(name))
    monkeypatch.setattr(platform, "_meminfo_field", lambda name: 100 * GIB)
    monkeypatch.setattr(platform, "_physical_memory", lambda: 128 * GIB)
    assert platform.available_host_memory() == 5 * GIB
    assert platform.total_host_memory() == 8 * GIB
    files.clear()  # no limit: the host's figures
    assert platform.available_host_memory() == 100 * GIB
    assert platform.total_host_memory() == 128 * GIB
