"""The executor contract the engine steps through, and the picklable description of a rank.

    engine process                               rank r (worker process or Ray actor)
    --------------                               -----------------------------------
    Scheduler -> SchedulerOutput
    executor.execute(output):
      broadcast ("execute", output) ──gloo──>    Worker.execute(output)
      rank 0's Worker.execute(output)            (same block ids, its own heads' KV cache)
         all-reduce / all-gather <──────────>    all-reduce / all-gather
      <- rank 0's ModelRunnerOutput              (its identical output is dropped)

The scheduler, the block tables and the sampling state's owner stay in the engine process;
every rank runs the same ModelRunner code on its shard, so with one seed every rank samples
the same tokens and only rank 0's are used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvserve.native.platform import CpuThreadPlan
from kvserve.step import ModelRunnerOutput, SchedulerOutput


class Executor(Protocol):
    """What the engine needs of whatever runs the model (ModelRunner satisfies it)."""

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput: ...

    def warm_up(self) -> None: ...


class ExecutorFailedError(RuntimeError):
    """A tensor-parallel rank died or a collective failed: the ranks can no longer agree on
    their state, so serving must stop (the engine re-raises it instead of failing a step)."""


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a rank needs to build itself, picklable (sent to processes and actors)."""

    model: str | None  # as --model gave it; every rank loads the checkpoint itself
    dtype: str  # resolved model dtype name, e.g. "float32"
    device: str  # "cpu" or "cuda"
    attention_backend: str
    tensor_parallel_size: int
    store_host: str  # the engine's TCPStore, which joins the ranks
    store_port: int
    seed: int
    # each rank's share of the engine's CPU thread plan (None: torch's threads as they are)
    cpu_plans: tuple[CpuThreadPlan | None, ...]

    @property
    def group_backend(self) -> str:
        return "nccl" if self.device == "cuda" else "gloo"


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
