"""A watchdog for the engine thread: a step or command that never returns must end the process.

The engine thread runs one unit of work at a time (a step, or a command such as a prefix-cache
reset).  A hung unit (a tensor-parallel collective whose peer hangs, a reset waiting on a store
that is gone, a kernel that never returns) blocks every request, while the event loop would go
on answering /health with 200.  The watchdog is a second thread that reads which unit runs and
since when; past the timeout it calls `on_stall` once, from its own thread, with the reason and
the stuck thread's stack.  Between units the engine is idle or waiting for commands, which is
never a stall; a long prompt is many steps of at most --max-num-batched-tokens each.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import NamedTuple


class EngineStalledError(RuntimeError):
    """The engine thread spent longer than --engine-stall-timeout in one step or command."""


class _Unit(NamedTuple):
    what: str  # "a step", "a command"
    since: float  # time.monotonic() when it began


class StallWatchdog:
    """Calls `on_stall(EngineStalledError)` once when one unit of work of the watched thread
    runs longer than `timeout_s`.  `begin`/`end` are called by the watched thread only; the
    current unit is one reference, replaced atomically, so no lock is needed."""

    def __init__(self, timeout_s: float, on_stall: Callable[[EngineStalledError], None]) -> None:
        self.timeout_s = timeout_s
        self._on_stall = on_stall
        self._unit: _Unit | None = None
        self._watched: int | None = None  # the watched thread's ident, for its stack
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="kvserve-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def begin(self, what: str) -> None:
        self._watched = threading.get_ident()
        self._unit = _Unit(what, time.monotonic())

    def end(self) -> None:
        self._unit = None

    def _watch(self) -> None:
        interval = min(1.0, self.timeout_s / 4)
        while not self._stop.wait(interval):
            unit = self._unit
            if unit is None:
                continue
            elapsed = time.monotonic() - unit.since
            if elapsed > self.timeout_s:
                self._on_stall(EngineStalledError(self._reason(unit, elapsed)))
                return

    def _reason(self, unit: _Unit, elapsed: float) -> str:
        frame = sys._current_frames().get(self._watched or -1)
        where = "".join(traceback.format_stack(frame)[-6:]) if frame is not None else "?\n"
        return (
            f"the engine thread has been in {unit.what} for {elapsed:.0f} s, longer than "
            f"--engine-stall-timeout ({self.timeout_s:g} s); it is at:\n{where.rstrip()}"
        )
