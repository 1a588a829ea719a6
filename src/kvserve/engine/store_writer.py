"""The writer of the prefix cache store (engine/prefix_store.py): a thread of its own that
writes and deletes the store's files, the bounded queue that feeds it, the directory's lock,
and the store's state, which any error turns OFF for good.

    engine thread                                   writer thread
    reserve(bytes) -> put(GroupWrite) ------------> save_file(.tmp-group-N) -> rename -> budget
    put(GroupDeletion) (a reset) -----------------> unlink this engine's groups
                     <------------- release(bytes) / fail(error): state OFF, num_errors + 1

At most `max_pending_bytes` of K/V copies wait in the queue (one group more when it is empty),
so a slow or dead disk holds a bounded amount of memory.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import json
import logging
import os
import queue
import re
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

logger = logging.getLogger("kvserve")

GROUP_NAME = re.compile(r"group-(\d{10})\.safetensors")


class StoreState(enum.Enum):
    WRITING = "writing"  # this server holds the directory's lock
    READ_ONLY = "read-only"  # another process holds it: its blocks read, nothing written
    OFF = "off"  # an error turned it off: nothing touches the disk any more


@dataclass
class GroupWrite:
    path: Path
    tensors: dict[str, torch.Tensor]
    num_blocks: int
    num_bytes: int  # reserved against max_pending_bytes until the writer is done with it


@dataclass
class GroupDeletion:
    paths: list[Path]


@dataclass(frozen=True)
class WriteCounts:
    """Blocks since start: written, dropped (the store off or read-only), still queued."""

    num_written: int
    num_not_written: int
    num_queued: int  # not written either once the writer is stopped


class StoreWriter:
    """Owns the writer thread and the store's state.  `reserve`, `put`, `drop_queued`,
    `count_not_written` and `stop` are the engine thread's; `fail` is anyone's."""

    def __init__(
        self,
        root: Path,
        directory: Path,
        fingerprint: dict[str, str],
        max_bytes: int,
        max_pending_bytes: int,
    ) -> None:
        self.root = root  # --prefix-cache-dir, whose size budget is max_bytes
        self.directory = directory  # this fingerprint's groups
        self.max_bytes = max_bytes
        self.max_pending_bytes = max_pending_bytes
        self.state = StoreState.WRITING
        self.num_errors = 0  # errors that turned the store off (kvserve:prefix_store_errors)
        self._metadata = {"fingerprint": json.dumps(fingerprint)}
        self._room = threading.Condition()  # guards the state and the counts
        self._num_queued_bytes = 0
        self._num_queued_blocks = 0
        self._num_written = 0
        self._num_not_written = 0
        self._unwritten: set[Path] = set()  # groups queued, their write not ended yet
        self._queue: queue.Queue[GroupWrite | GroupDeletion | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="kvserve-store", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def fail(self, exc: BaseException, doing: str) -> None:
        """Turn the store off for good: one error line naming the directory, one more error."""
        with self._room:
            self.num_errors += 1
            was_on = self.state is not StoreState.OFF
            self.state = StoreState.OFF
            self._room.notify_all()
        if was_on:
            logger.error(
                "prefix cache store %s is off: %s failed (%s: %s); serving goes on without it",
                self.root, doing, type(exc).__name__, exc,
            )  # fmt: skip

    # ------------------------------------------------------------------ engine thread
    def reserve(self, num_blocks: int, num_bytes: int, wait: float) -> bool:
        """Room for one more group's copies (always when the queue is empty); waits up to
        `wait` seconds for the writer to make it.  False when there is none, or the store is
        not WRITING."""

        def has_room() -> bool:
            queued = self._num_queued_bytes
            return queued == 0 or queued + num_bytes <= self.max_pending_bytes

        with self._room:
            if wait > 0:
                self._room.wait_for(lambda: has_room() or not self.writing, wait)
            if not self.writing or not has_room():
                return False
            self._num_queued_bytes += num_bytes
            self._num_queued_blocks += num_blocks
            return True

    @property
    def writing(self) -> bool:
        return self.state is StoreState.WRITING

    def put(self, item: GroupWrite | GroupDeletion) -> None:
        """Queue a write (its room reserved first) or a deletion."""
        if isinstance(item, GroupWrite):
            with self._room:
                self._unwritten.add(item.path)
        self._queue.put(item)

    def is_queued(self, path: Path) -> bool:
        """Whether the group at `path` is queued or being written (not on disk yet)."""
        with self._room:
            return path in self._unwritten

    def drop_queued(self) -> None:
        """Forget the writes not started yet (a reset: their blocks are gone)."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                self._release(item)
            self._queue.task_done()

    def join(self) -> None:
        """Wait until everything queued is done (tests; a live server never waits)."""
        self._queue.join()

    def count_not_written(self, num_blocks: int) -> None:
        with self._room:
            self._num_not_written += num_blocks

    def counts(self) -> WriteCounts:
        with self._room:
            return WriteCounts(self._num_written, self._num_not_written, self._num_queued_blocks)

    @property
    def num_pending_bytes(self) -> int:
        """Bytes of K/V copies waiting for the writer (or being written)."""
        return self._num_queued_bytes

    def stop(self, patience: float) -> bool:
        """Stop the thread after what is queued; False when it is stuck: it finished nothing
        for `patience` seconds."""
        if not self._thread.is_alive():
            return True
        self._queue.put(None)
        done = -1
        while self._thread.is_alive() and done != self._num_written:
            done = self._num_written
            self._thread.join(patience)
        return not self._thread.is_alive()

    # ------------------------------------------------------------------ writer thread
    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                if self.writing and isinstance(item, GroupWrite):
                    self._write(item)
                    self._enforce_budget()
                elif self.writing:
                    self._delete(item)
                elif isinstance(item, GroupWrite):
                    self.count_not_written(item.num_blocks)
            except Exception as exc:  # noqa: BLE001 - any error: the store turns off
                self.fail(exc, _doing(item))
            finally:
                self._release(item)
                self._queue.task_done()

    def _write(self, item: GroupWrite) -> None:
        temporary = item.path.with_name(f".tmp-{item.path.name}")
        try:
            save_file(item.tensors, str(temporary), metadata=self._metadata)
            os.replace(temporary, item.path)
        except BaseException:
            self.count_not_written(item.num_blocks)
            with contextlib.suppress(OSError):
                temporary.unlink(missing_ok=True)
            raise
        with self._room:
            self._num_written += item.num_blocks

    def _delete(self, item: GroupDeletion) -> None:
        if not self.directory.is_dir():
            raise FileNotFoundError(f"{self.directory} is gone or not a directory")
        for path in item.paths:
            path.unlink(missing_ok=True)

    def _enforce_budget(self) -> None:
        """Delete the oldest groups (any fingerprint) while the directory exceeds the budget
        (the engine's index keeps a deleted group's keys until a read finds it gone)."""
        files = []
        for path in self.root.glob("*/group-*.safetensors"):
            with contextlib.suppress(FileNotFoundError):
                info = path.stat()
                if GROUP_NAME.fullmatch(path.name) and stat.S_ISREG(info.st_mode):
                    files.append((info.st_mtime, path, info.st_size))
        total = sum(size for _, _, size in files)
        for _, path, size in sorted(files):
            if total <= self.max_bytes:
                return
            total -= size
            path.unlink(missing_ok=True)

    def _release(self, item: GroupWrite | GroupDeletion) -> None:
        if isinstance(item, GroupWrite):
            with self._room:
                self._unwritten.discard(item.path)
                self._num_queued_bytes -= item.num_bytes
                self._num_queued_blocks -= item.num_blocks
                self._room.notify_all()


def _doing(item: GroupWrite | GroupDeletion) -> str:
    if isinstance(item, GroupWrite):
        return f"writing {item.path} (or keeping the size budget)"
    return f"deleting {len(item.paths)} groups (a reset)"


def try_lock(path: Path) -> tuple[int | None, str | None]:
    """(an open descriptor holding the exclusive lock, None), or (None, the holder's pid as it
    wrote it) when another process (or another descriptor) holds it.  The lock goes with the
    descriptor: closing it, or the process ending (even killed), releases it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        return None, holder
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd, None
