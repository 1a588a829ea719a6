"""Device and dtype resolution, the memory figures the KV sizing needs, and where a CPU
engine's threads run (the plan, and pinning through the native library's runtime part)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvserve.config import parse_cpu_list
from kvserve.errors import ParameterError
from kvserve.native import ops
from kvserve.native.build import KernelBuildError

CPU_DEFAULT_KV_BYTES = 4 * 1024**3  # vLLM's CPU backend default


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ParameterError("--device", "cuda was given but no CUDA device is available; use cpu")
    if device.type not in ("cpu", "cuda"):
        raise ParameterError("--device", f"must be cpu, cuda, cuda:N or auto, got {name!r}")
    return device


NATIVE_BF16_ENV = "KVSERVE_CPU_NATIVE_BF16"


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: bfloat16 matmuls are then faster than float32, not emulated.

    KVSERVE_CPU_NATIVE_BF16=0 or 1 overrides the detection both ways, so `--dtype auto` can be
    pinned to float32 on a bf16 CPU (reproducible float32 results) and the bfloat16 path can be
    exercised on a CPU without bf16 (tests of both auto paths on any machine)."""
    forced = os.environ.get(NATIVE_BF16_ENV, "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    if forced:
        raise ParameterError(
            NATIVE_BF16_ENV, f"must be 0 or 1 (or unset to detect), got {forced!r}"
        )
    capability = torch.backends.cpu.get_cpu_capability()
    if "AMX" in capability or "BF16" in capability:
        return True
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16": the spelling of --dtype and of the KV accounting."""
    return str(dtype).removeprefix("torch.")


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
    """Bytes this process could still allocate: MemAvailable from /proc/meminfo (total physical
    memory when unreadable), capped by a cgroup v2 limit, because inside a container
    /proc/meminfo shows the host's memory, not the container's."""
    available = _meminfo_field("MemAvailable:") or _physical_memory()
    limit = _read_cgroup_bytes("memory.max")
    if limit is not None:
        available = min(available, max(0, limit - (_read_cgroup_bytes("memory.current") or 0)))
    return available


def total_host_memory() -> int:
    """Physical memory, or the cgroup v2 limit when that is smaller."""
    limit = _read_cgroup_bytes("memory.max")
    return min(_physical_memory(), limit) if limit is not None else _physical_memory()


def total_device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return total_host_memory()


def non_torch_device_memory(device: torch.device) -> int:
    """Device memory in use that PyTorch's caching allocator does not hold: the CUDA context,
    library workspaces, other processes (total - free - reserved by this process's torch)."""
    if device.type != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info(device)
    return max(0, total - free - torch.cuda.memory_reserved(device))


def _physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _meminfo_field(name: str) -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith(name):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def _read_cgroup_bytes(name: str, root: str = "/sys/fs/cgroup") -> int | None:
    """A cgroup v2 memory file of this process's group in bytes; None when absent or 'max'."""
    try:
        with open(os.path.join(root, name), encoding="ascii") as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


@dataclass(frozen=True)
class CpuThreadPlan:
    """Where a CPU engine computes: one torch thread per entry of `compute_cpus`, each pinned
    to its CPU when `pin`; the server's other threads (event loop, tokenizers) on
    `server_cpus` (empty: wherever the OS puts them)."""

    compute_cpus: tuple[int, ...]
    pin: bool
    server_cpus: tuple[int, ...] = ()


def physical_core_of(cpu: int, sysfs: str = "/sys/devices/system/cpu") -> tuple[str, str]:
    """(package, core) of a logical CPU: hyper-threads of one core share it."""
    topology = os.path.join(sysfs, f"cpu{cpu}", "topology")
    try:
        with open(os.path.join(topology, "physical_package_id"), encoding="ascii") as f:
            package = f.read().strip()
        with open(os.path.join(topology, "core_id"), encoding="ascii") as f:
            return package, f.read().strip()
    except OSError:
        return "", str(cpu)  # no topology: every CPU its own core


def plan_cpu_threads(
    spec: str, allowed: list[int], core_of: Callable[[int], tuple[str, str]] = physical_core_of
) -> CpuThreadPlan:
    """--cpu-threads-bind: `all` computes on every allowed CPU, unpinned (hyper-threads
    included); a CPU list pins one compute thread per listed CPU and leaves the rest to the
    server; `auto` is `all` on up to 2 physical cores (each is needed for compute), and beyond
    that one pinned thread per physical core, minus the first core, which serves HTTP,
    streaming and tokenization so they never preempt a compute thread (vLLM's CPU backend
    reserves a core likewise)."""
    if spec == "all":
        return CpuThreadPlan(tuple(allowed), pin=False)
    if spec != "auto":
        cpus = parse_cpu_list(spec)
        outside = sorted(set(cpus) - set(allowed))
        if outside:
            raise ParameterError(
                "--cpu-threads-bind",
                f"CPUs {outside} are not available to this process (it may use {allowed})",
            )
        rest = tuple(c for c in allowed if c not in cpus)
        return CpuThreadPlan(tuple(cpus), pin=True, server_cpus=rest)
    first_of_core: dict[tuple[str, str], int] = {}
    for cpu in allowed:
        first_of_core.setdefault(core_of(cpu), cpu)
    if len(first_of_core) <= 2:
        return CpuThreadPlan(tuple(allowed), pin=False)
    cores = list(first_of_core)
    server = tuple(c for c in allowed if core_of(c) == cores[0])
    return CpuThreadPlan(tuple(first_of_core[c] for c in cores[1:]), pin=True, server_cpus=server)


def set_cpu_threads(spec: str = "auto") -> CpuThreadPlan | None:
    """Size torch's CPU threads by --cpu-threads-bind (plan_cpu_threads) and pin this thread's
    OpenMP team when the plan pins; None when OMP_NUM_THREADS decides (it is honoured as it
    is: on a shared machine fewer threads avoid waiting on a descheduled sibling thread,
    measured 7-15x slower with 2 threads on 2 busy cores).  The thread that later runs the
    engine's steps calls bind_compute_threads again: each thread has its own OpenMP team."""
    if os.environ.get("OMP_NUM_THREADS") and spec == "auto":
        return None
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux: torch's default
        return None
    plan = plan_cpu_threads(spec, allowed)
    torch.set_num_threads(len(plan.compute_cpus))
    bind_compute_threads(plan)
    return plan


def bind_compute_threads(plan: CpuThreadPlan | None) -> None:
    """Pin the calling thread's OpenMP team (torch's CPU threads when this thread runs the
    model) one thread per compute CPU; nothing for an unpinned plan."""
    if plan is None or not plan.pin:
        return
    try:
        pinned = ops.kernels().bind_omp_threads(plan.compute_cpus)
    except (KernelBuildError, OSError, subprocess.SubprocessError) as exc:
        raise ParameterError(
            "--cpu-threads-bind", f"pinning needs the native library, which failed: {exc}"
        ) from exc
    if not pinned:
        raise ParameterError(
            "--cpu-threads-bind", f"could not pin compute threads to CPUs {plan.compute_cpus}"
        )


def bind_server_threads(plan: CpuThreadPlan | None) -> None:
    """Keep the calling thread (and the threads it starts later) on the server's CPUs."""
    if plan is not None and plan.server_cpus:
        os.sched_setaffinity(0, plan.server_cpus)
