"""Device and dtype resolution, and the memory figures the KV sizing needs."""

from __future__ import annotations

import os

import torch

CPU_DEFAULT_KV_BYTES = 4 * 1024**3  # vLLM's CPU backend default


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was given but no CUDA device is available; use cpu")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu, cuda, cuda:N or auto, got {name!r}")
    return device


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: bfloat16 matmuls are then faster than float32, not emulated."""
    capability = torch.backends.cpu.get_cpu_capability()
    if "AMX" in capability or "BF16" in capability:
        return True
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str, device: torch.device, checkpoint_dtype: str) -> torch.dtype:
    """--dtype auto: bfloat16 on a CPU with native bf16 (else float32); on CUDA the
    checkpoint's dtype (float16 when it is float32, as vLLM does)."""
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cpu":
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    dtype = getattr(torch, checkpoint_dtype, torch.float32)
    if dtype == torch.float32:
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return dtype


def available_host_memory() -> int:
    """MemAvailable from /proc/meminfo (bytes); falls back to total physical memory."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def total_device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def set_cpu_threads() -> None:
    """Use every core the process may run on (torch's default can count hyper-threads), unless
    OMP_NUM_THREADS says otherwise: on a shared machine fewer threads avoid waiting on a
    descheduled sibling thread (measured 7-15x slower with 2 threads on 2 busy cores)."""
    if os.environ.get("OMP_NUM_THREADS"):
        return
    try:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))
    except AttributeError:
        pass
