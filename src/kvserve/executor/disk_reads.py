"""With N ranks, a disk-tier read is done when every rank's is.

Each rank keeps its own file of a block (its KV heads) and its own reader thread, so one
block's read ends at a different time on each rank, and may fail on one only (its file gone
or corrupt).  The scheduler sees rank 0's output alone: had it trusted rank 0's reads, another
rank would load a host slot that its own read had not filled yet, or never would.  So every
rank reports, for each read under way, whether its share has ended or failed; a read is
passed on once it has ended on every rank, as failed (a miss: recomputed) when it failed on
any.  The reads under way are the same list on every rank: every rank gets the same
scheduler outputs, in which the reads start.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kvserve.models.parallel import TPGroup
from kvserve.step import ModelRunnerOutput, SchedulerOutput

UNDER_WAY, DONE, FAILED = 0, 1, 2


class DiskReadsOfEveryRank:
    """Wraps each step's output: its disk reads become the ones every rank has finished."""

    def __init__(self, group: TPGroup) -> None:
        self.group = group
        self._under_way: list[bytes] = []  # in the order the reads started: every rank's
        self._done: set[bytes] = set()  # this rank's share ended, not passed on yet
        self._failed: set[bytes] = set()

    def agree(self, output: SchedulerOutput, result: ModelRunnerOutput) -> ModelRunnerOutput:
        """`result` (this rank's step) with the reads that ended on every rank; a collective
        on the steps where some read is under way (on every rank alike)."""
        self._under_way += [key for key, _ in output.disk_to_host]
        self._done.update(result.disk_reads_done)
        self._failed.update(result.disk_reads_failed)
        if not self._under_way:
            return result
        mine = torch.tensor([self._status(key) for key in self._under_way], dtype=torch.int32)
        every_rank = torch.stack(self.group.all_gather(mine))  # [ranks, reads]
        ended = (every_rank != UNDER_WAY).all(0).tolist()
        failed = (every_rank == FAILED).any(0).tolist()
        done_keys, failed_keys, still = [], [], []
        for key, has_ended, has_failed in zip(self._under_way, ended, failed, strict=True):
            if not has_ended:
                still.append(key)
                continue
            (failed_keys if has_failed else done_keys).append(key)
            self._done.discard(key)
            self._failed.discard(key)
        self._under_way = still
        return replace(result, disk_reads_done=tuple(done_keys),
                       disk_reads_failed=tuple(failed_keys))  # fmt: skip

    def _status(self, key: bytes) -> int:
        return FAILED if key in self._failed else DONE if key in self._done else UNDER_WAY
