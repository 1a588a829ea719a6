"""--distributed-executor-backend mp: ranks 1..N-1 as local processes (spawned, never
forked: the engine process already runs torch's thread pools)."""

from __future__ import annotations

import multiprocessing
import sys
import traceback
from multiprocessing.connection import wait

from kvserve.executor.base import WorkerSpec

STOP_TIMEOUT_S = 10.0


def _process_main(spec: WorkerSpec, rank: int) -> None:
    from kvserve.executor.worker import run_worker

    try:
        run_worker(spec, rank)
    except BaseException:  # noqa: BLE001 - report, then exit non-zero: the engine sees it
        print(f"kvserve tensor-parallel rank {rank} failed:", file=sys.stderr)
        traceback.print_exc()
        sys.stderr.flush()
        sys.exit(1)


class MultiprocLauncher:
    host = "127.0.0.1"

    def __init__(self) -> None:
        self._context = multiprocessing.get_context("spawn")
        self.processes: dict[int, multiprocessing.process.BaseProcess] = {}
        self._stop_reader, self._stop_writer = self._context.Pipe(duplex=False)

    def start(self, spec: WorkerSpec) -> None:
        for rank in range(1, spec.world_size):
            process = self._context.Process(
                target=_process_main, args=(spec, rank), name=f"kvserve-tp-rank-{rank}",
                daemon=True,
            )  # fmt: skip
            process.start()
            self.processes[rank] = process

    def worker_pids(self) -> dict[int, int]:
        return {rank: process.pid for rank, process in self.processes.items()}

    def dead_rank(self) -> tuple[int, str] | None:
        for rank, process in self.processes.items():
            if process.exitcode is not None:
                return rank, f"pid {process.pid}, {_describe_exit(process.exitcode)}"
        return None

    def wait_for_death(self) -> tuple[int, str] | None:
        sentinels = {p.sentinel: rank for rank, p in self.processes.items()}
        ready = wait([*sentinels, self._stop_reader])
        if self._stop_reader in ready:
            return None
        for process in self.processes.values():
            process.join(0.5)  # sets exitcode
        return self.dead_rank()

    def stop(self) -> None:
        self._stop_writer.send(None)
        for process in self.processes.values():
            process.join(STOP_TIMEOUT_S)
            if process.exitcode is None:
                process.kill()
                process.join(STOP_TIMEOUT_S)


def _describe_exit(code: int) -> str:
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"
