"""What every executor shares: the error that ends serving, the picklable description of a
rank, the CPU thread plan shared out among ranks, and the one place that says what N ranks do
not run, and why.

    engine process                               rank r (worker process or Ray actor)
    --------------                               -----------------------------------
    Scheduler -> SchedulerOutput
    executor.execute(output):
      broadcast ("execute", output) ──gloo──>    Worker.execute(output)
      rank 0's Worker.execute(output)            (same block ids, its own heads' KV cache)
         all-reduce / all-gather <──────────>    all-reduce / all-gather
      <- rank 0's ModelRunnerOutput              (its identical output is dropped)

With one rank the same Worker runs in the engine process and nothing is broadcast.  The
scheduler, the block tables and the sampling state's owner stay in the engine process; every
rank runs the same ModelRunner code on its shard, so with one seed every rank samples the same
tokens and only rank 0's are used.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvserve.config import EngineConfig
from kvserve.native import platform
from kvserve.native.platform import CpuThreadPlan

logger = logging.getLogger("kvserve")

# What one rank runs and N ranks do not, and why: decided here only.  Each is a path taken
# only where it serves, left off with one log line (tensor_parallel_refuses); no flag is
# refused.
NOT_WITH_TENSOR_PARALLEL = {
    "native layers": (
        "native/csrc/layer/decode_layer.c adds o_proj's and down_proj's outputs to the "
        "residual within one call, where N ranks hold partial sums that must first be all-reduced"
    ),
    "CUDA graphs": "capturing NCCL collectives in CUDA graphs has not been tested",
}


def tensor_parallel_refuses(feature: str, world_size: int) -> bool:
    """True, with one log line (rank 0's reaches the engine's log), where `world_size` ranks
    do not run `feature` (a key of NOT_WITH_TENSOR_PARALLEL)."""
    if world_size == 1:
        return False
    logger.info("tensor parallel: no %s (%s)", feature, NOT_WITH_TENSOR_PARALLEL[feature])
    return True


def set_cpu_threads(spec: str) -> CpuThreadPlan | None:
    """Size torch's CPU threads by --cpu-threads-bind, pinning the calling thread's team when
    the plan pins (native/platform.py); the plan, or None where OMP_NUM_THREADS decides."""
    return platform.set_cpu_threads(spec)


def bind_compute_threads(plan: CpuThreadPlan | None) -> None:
    """The calling thread runs rank 0's steps: pin its OpenMP team as `plan` says."""
    platform.bind_compute_threads(plan)


def bind_server_threads(plan: CpuThreadPlan | None) -> None:
    """Keep the calling thread (and those it starts) off the compute CPUs of `plan`."""
    platform.bind_server_threads(plan)


class ExecutorFailedError(RuntimeError):
    """A tensor-parallel rank died or a collective failed: the ranks can no longer agree on
    their state, so serving must stop (the engine re-raises it instead of failing a step)."""


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a rank needs to build itself, picklable (sent to processes and actors)."""

    config: EngineConfig  # every rank loads the checkpoint of config.load.model itself
    dtype: str  # rank 0's resolved model dtype name, e.g. "float32"
    device: str  # rank 0's resolved device: "cpu", "cuda", "cuda:1"
    # N > 1: the engine's TCPStore, which joins the ranks, and each rank's share of the
    # engine's CPU thread plan (None: torch's threads as they are)
    store_host: str = ""
    store_port: int = 0
    cpu_plans: tuple[CpuThreadPlan | None, ...] = (None,)

    @property
    def world_size(self) -> int:
        return self.config.load.tensor_parallel_size

    @property
    def group_backend(self) -> str:
        return "nccl" if self.device.startswith("cuda") else "gloo"


def split_cpu_plan(
    plan: CpuThreadPlan | None, tensor_parallel_size: int, pin_workers: bool
) -> tuple[CpuThreadPlan | None, ...]:
    """The engine's CPU thread plan (--cpu-threads-bind) shared out among the ranks on one
    machine: contiguous slices of its compute CPUs, so that N ranks never run N x the threads
    on the same cores.  Rank 0 keeps the server's CPUs; ranks elsewhere (`pin_workers` False:
    Ray may place them on other machines) keep their thread count but pin nothing.  With
    fewer CPUs than ranks every rank gets one thread, unpinned; None (OMP_NUM_THREADS
    decides) stays None for every rank."""
    if plan is None:
        return (None,) * tensor_parallel_size
    cpus = plan.compute_cpus
    if len(cpus) < tensor_parallel_size:
        return (CpuThreadPlan(cpus[:1], pin=False, server_cpus=plan.server_cpus),) + (
            CpuThreadPlan(cpus[:1], pin=False),
        ) * (tensor_parallel_size - 1)
    base, extra = divmod(len(cpus), tensor_parallel_size)
    plans, start = [], 0
    for rank in range(tensor_parallel_size):
        stop = start + base + (1 if rank < extra else 0)
        pin = plan.pin and (rank == 0 or pin_workers)
        server = plan.server_cpus if rank == 0 else ()
        plans.append(CpuThreadPlan(cpus[start:stop], pin=pin, server_cpus=server))
        start = stop
    return tuple(plans)
