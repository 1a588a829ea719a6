"""One rank, in the engine process: its Worker's methods are called directly (no process group,
no broadcast, no copy of the step's data)."""

from __future__ import annotations

from typing import Any

import torch

from kvserve.config import EngineConfig
from kvserve.executor.abstract import Executor
from kvserve.executor.base import CpuThreadPlan, WorkerSpec
from kvserve.executor.worker import Worker
from kvserve.models.loader import Checkpoint
from kvserve.step import ModelRunnerOutput, SchedulerOutput


class UniProcExecutor(Executor):
    def __init__(
        self,
        config: EngineConfig,
        checkpoint: Checkpoint,
        dtype: str,
        device: torch.device,
        cpu_threads: CpuThreadPlan | None = None,
    ) -> None:
        self.config = config
        self.cpu_threads = cpu_threads
        spec = WorkerSpec(config, dtype, str(device))
        self.driver_worker = Worker(spec, 0, checkpoint)

    def collective_rpc(self, method: str, *args: object) -> Any:
        return getattr(self.driver_worker, method)(*args)

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        """The step itself, without collective_rpc's lookup by name."""
        return self.driver_worker.execute(output)
