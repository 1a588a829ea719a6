"""`make_executor`: the executor for the configured rank count (its own module, so that the
executors may import their base class while the factory imports every executor)."""

from __future__ import annotations

from kvserve.config import EngineConfig
from kvserve.executor.abstract import Executor
from kvserve.executor.base import set_cpu_threads
from kvserve.executor.tensor_parallel import TensorParallelExecutor
from kvserve.executor.uniproc import UniProcExecutor
from kvserve.executor.worker import resolve_placement
from kvserve.models.loader import Checkpoint, load_checkpoint


def make_executor(config: EngineConfig, checkpoint: Checkpoint | None = None) -> Executor:
    """The executor for config.load.tensor_parallel_size ranks, every model built.  The
    calling thread's CPU threads are sized first (--cpu-threads-bind): the checkpoint loads
    with them."""
    load = config.load
    cpu_threads = set_cpu_threads(load.cpu_threads_bind)
    checkpoint = checkpoint or load_checkpoint(load.model)
    device, dtype = resolve_placement(load, checkpoint.config)
    if load.tensor_parallel_size > 1:
        return TensorParallelExecutor(config, checkpoint, dtype, device, cpu_threads)
    return UniProcExecutor(config, checkpoint, dtype, device, cpu_threads)
