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
