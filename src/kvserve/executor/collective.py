"""How tensor-parallel ranks join and follow rank 0: their process groups, the pickled
(method, args) that rank 0 broadcasts for every call, and the loop of ranks 1..N-1.

Rank 0 lives in the engine process; ranks 1..N-1 run `run_worker` in a worker process or a
Ray actor.  Every call reaches every rank in the same order, over the CPU (gloo) group; None
ends the loop.
"""

from __future__ import annotations

import datetime
import pickle
from typing import Any

import torch
import torch.distributed as dist

from kvserve.executor.base import WorkerSpec, bind_compute_threads
from kvserve.models.parallel import TPGroup

# An idle server waits for its next step inside a broadcast: the collective timeout must not
# end it.  A rank that dies is seen at once anyway (its sockets close; the executor's monitor
# watches the processes), so the timeout only bounds a peer that hangs without dying.
COLLECTIVE_TIMEOUT = datetime.timedelta(days=365)
STORE_TIMEOUT = datetime.timedelta(seconds=600)


def make_process_group(
    store: dist.Store, prefix: str, backend: str, rank: int, world_size: int
) -> Any:
    """A process group of its own (not torch's global default group)."""
    prefixed = dist.PrefixStore(prefix, store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, world_size, COLLECTIVE_TIMEOUT)
    return dist.ProcessGroupNCCL(prefixed, rank, world_size)


def broadcast_object(group: TPGroup, obj: object) -> None:
    """Rank 0: send one picklable object to every other rank (size, then bytes)."""
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    group.process_group.broadcast(torch.tensor([payload.numel()]), 0).wait()
    group.process_group.broadcast(payload, 0).wait()


def receive_object(group: TPGroup) -> Any:
    """Ranks > 0: the next object rank 0 broadcasts."""
    size = torch.zeros(1, dtype=torch.long)
    group.process_group.broadcast(size, 0).wait()
    payload = torch.empty(int(size), dtype=torch.uint8)
    group.process_group.broadcast(payload, 0).wait()
    return pickle.loads(payload.numpy().tobytes())


def run_worker(spec: WorkerSpec, rank: int) -> None:
    """A rank > 0 from start to end: build, join, then follow rank 0's calls until None."""
    from kvserve.executor.worker import Worker

    cpu_plan = spec.cpu_plans[rank]
    if cpu_plan is not None:  # this process's main thread runs the steps: its team
        torch.set_num_threads(len(cpu_plan.compute_cpus))
        bind_compute_threads(cpu_plan)
    store = dist.TCPStore(
        spec.store_host, spec.store_port, spec.world_size, False, timeout=STORE_TIMEOUT
    )
    worker = Worker(spec, rank)
    worker.join(store)
    with torch.inference_mode():
        while True:
            message = receive_object(worker.cpu_group)
            if message is None:
                return
            method, args = message
            getattr(worker, method)(*args)
