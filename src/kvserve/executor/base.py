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
    num_threads: int  # torch intra-op threads per rank on a CPU

    @property
    def group_backend(self) -> str:
        return "nccl" if self.device == "cuda" else "gloo"
