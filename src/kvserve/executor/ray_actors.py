"""--distributed-executor-backend ray: ranks 1..N-1 as Ray actors.

The cluster is the one RAY_ADDRESS names or one running on this machine (`ray start --head`,
`ray start --address=...` on the other machines); when there is none, `ray.init()` starts a
local one, which stops with the engine.  On CUDA each actor asks for one GPU, so Ray places
the ranks on the cluster's GPUs, across machines when it must; rank 0 stays in the engine
process.  Each actor runs the whole worker loop in one long call, whose end (normal, or
ActorDiedError when the actor's process dies) is how the monitor learns of a death.
"""

from __future__ import annotations

import logging
import os

from kvserve.executor.base import WorkerSpec

logger = logging.getLogger("kvserve")


class _RankActor:
    """The body of one Ray actor: a rank's whole life in `run`."""

    def run(self, spec: WorkerSpec, rank: int) -> int:
        from kvserve.executor.worker import run_worker

        run_worker(spec, rank)
        return rank

    def pid(self) -> int:
        return os.getpid()


class RayLauncher:
    def __init__(self) -> None:
        import ray

        self._ray = ray
        self._connected_here = False  # then `stop` disconnects (and ends a cluster it started)
        if not ray.is_initialized():
            context = ray.init(logging_level=logging.WARNING, include_dashboard=False)
            self._connected_here = True
            logger.info("ray: cluster at %s", context.address_info.get("gcs_address"))
        self.host = ray.util.get_node_ip_address()
        self.actors: dict[int, object] = {}
        self._runs: dict[object, int] = {}  # ObjectRef of each actor's run -> rank
        self._pids: dict[int, int] = {}
        self._stopping = False

    def start(self, spec: WorkerSpec) -> None:
        gpus = 1 if spec.device.startswith("cuda") else 0
        actor_class = self._ray.remote(num_cpus=1 if gpus == 0 else 0, num_gpus=gpus)(_RankActor)
        for rank in range(1, spec.world_size):
            self.actors[rank] = actor_class.options(max_restarts=0).remote()
        # asked before `run`, which occupies each actor for good
        pids = self._ray.get([actor.pid.remote() for actor in self.actors.values()])
        self._pids = dict(zip(self.actors, pids, strict=True))
        for rank, actor in self.actors.items():
            self._runs[actor.run.remote(spec, rank)] = rank

    def worker_pids(self) -> dict[int, int]:
        return dict(self._pids)

    def dead_rank(self) -> tuple[int, str] | None:
        done, _ = self._ray.wait(list(self._runs), num_returns=1, timeout=0)
        return self._report(done[0]) if done else None

    def wait_for_death(self) -> tuple[int, str] | None:
        done, _ = self._ray.wait(list(self._runs), num_returns=1, timeout=None)
        if self._stopping:
            return None
        return self._report(done[0])

    def _report(self, ref: object) -> tuple[int, str]:
        rank = self._runs[ref]
        try:
            self._ray.get(ref)
        except Exception as exc:  # noqa: BLE001 - ActorDiedError, or the worker's own error
            return rank, f"Ray actor: {type(exc).__name__}: {str(exc).splitlines()[0]}"
        return rank, "Ray actor returned"

    def stop(self) -> None:
        self._stopping = True
        try:
            self._ray.wait(list(self._runs), num_returns=len(self._runs), timeout=10)
        finally:
            for actor in self.actors.values():
                self._ray.kill(actor)
            if self._connected_here:
                self._ray.shutdown()
