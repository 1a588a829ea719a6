"""AsyncLLM: the engine behind an asyncio server, stepping on a thread of its own.

The engine is not thread-safe, so exactly one thread (``kvserve-engine``) ever touches it:

    event loop (server)                      engine thread
    -------------------                      -------------
    generate(): submit add  --commands-->    run commands (add / abort)
                await its Future  <-------   resolve Future (or ValueError)
                await queue.get() <-------   step() -> call_soon_threadsafe(queue.put_nowait)
    abort():    submit abort --commands-->   abort_request(): blocks freed before the next step

A consumer that falls behind (a client that stops reading its stream) must not make the
server hold a backlog: each request's outputs wait in an `OutputCollector`, which keeps only the
newest output of a CUMULATIVE request and coalesces a DELTA request's outputs (the server's
kind), so what a request holds is O(its output) whatever its reader does.

The engine thread also builds the engine (`AsyncLLM.launch`), so that one thread runs every
torch op of the process.  libgomp keeps a thread team for each thread that ever ran a parallel
region; an engine built on the main thread and stepped on another leaves two teams, more
OpenMP threads than CPUs on a small machine, and libgomp then throttles its barrier spinning to
~100 spins: every parallel region ends in a futex sleep and wake-up.  That cost served W1 30%
(offline W1 stepped from a second thread: 30.0 s against 23.1 s; built there too: 24.3 s).

Faults: a step that raises fails only its own requests (their streams get
RequestFailedError, their blocks are freed) and the engine goes on.  When it cannot go on
(MAX_CONSECUTIVE_STEP_FAILURES failed steps in a row, broken bookkeeping, any error outside a
step) the thread stops, every stream gets EngineDeadError, and `on_fatal` is called so that the
process can exit non-zero and its supervisor restart it, instead of answering 503 for ever.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from kvserve.config import DEFAULT_RETENTION_PRIORITY
from kvserve.engine.gc_freeze import heap_frozen
from kvserve.engine.llm_engine import LLMEngine, StepFailedError
from kvserve.engine.watchdog import EngineStalledError, StallWatchdog
from kvserve.errors import QueueFullError, RequestFailedError
from kvserve.executor.base import bind_compute_threads, bind_server_threads
from kvserve.request import RequestOutputKind, SamplingParams
from kvserve.step import RequestOutput, SchedulerStats, merge_deltas

logger = logging.getLogger("kvserve")

ENGINE_THREAD = "kvserve-engine"
MAX_CONSECUTIVE_STEP_FAILURES = 3  # then the fault is not in one request: stop serving
# An idle engine that receives a request waits while more keep arriving (each within
# BURST_GAP_S of the one before, BURST_WINDOW_S at most) before its first step: a client's
# burst then starts in one full step instead of its first request's step alone.  W3's 64
# prompts sharing 1,024 tokens otherwise ran as the first prompt (1,056 tokens, half a step's
# budget) and then the 63 others, all behind it: TTFT p50 was both steps.  A lone request
# pays one gap.
BURST_GAP_S = 0.002
BURST_WINDOW_S = 0.05


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (shutdown, or a step failed); requests cannot proceed."""


class OutputCollector:
    """The outputs of one request its reader has not taken yet (event-loop side; vLLM's
    RequestOutputCollector).  DELTA outputs are coalesced, the others replaced by the newest,
    so memory is O(the request's output) however far behind the reader is.  Deltas are merged
    in chunks of CHUNK as they arrive (one object per chunk, not per step) and joined once
    when taken."""

    CHUNK = 32

    def __init__(self, kind: RequestOutputKind) -> None:
        self._delta = kind is RequestOutputKind.DELTA
        self._chunks: list[RequestOutput] = []
        self._recent: list[RequestOutput] = []
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            self._error = item
        elif not self._delta:
            self._recent = [item]
        else:
            self._recent.append(item)
            if len(self._recent) >= self.CHUNK:
                self._chunks.append(merge_deltas(self._recent))
                self._recent = []
        self._ready.set()

    async def get(self) -> RequestOutput:
        """Everything collected since the last call (waits for something); raises the error
        that ended the request, after the outputs that came before it."""
        await self._ready.wait()
        pending = self._chunks + self._recent
        self._chunks, self._recent = [], []
        if pending:
            if self._error is None:
                self._ready.clear()
            return merge_deltas(pending) if self._delta else pending[-1]
        assert self._error is not None
        raise self._error


@dataclass
class _Stream:
    """Where one request's outputs go: a collector owned by the event loop that awaits it."""

    loop: asyncio.AbstractEventLoop
    collector: OutputCollector

    def put(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.collector.put, item)
        except RuntimeError:
            pass  # the loop is closed: nobody is listening any more


class AsyncLLM:
    """Owns an LLMEngine and serializes every call to it on one background thread."""

    def __init__(
        self,
        engine: LLMEngine,
        max_waiting_sequences: int | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.engine = engine
        self.max_waiting_sequences = max_waiting_sequences  # None: unbounded (offline use)
        self.on_fatal = on_fatal  # called on the engine thread once it has stopped for good
        self._consecutive_failures = 0
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future]]
        self._commands = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._lock = threading.Lock()  # orders command submission against the final drain
        self._closed = False  # set once, under _lock, when no command will run any more
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._stopping = False
        self._error: BaseException | None = None
        self.stats: SchedulerStats = engine.get_stats()  # replaced (never mutated) per step
        self._thread = threading.Thread(target=self._run, name=ENGINE_THREAD, daemon=True)
        self._go: threading.Event | None = None  # set by launch(): its thread waits for start()
        self._watchdog: StallWatchdog | None = None  # start() with a stall timeout
        engine.on_executor_failure(self._fail_from_outside)

    @classmethod
    def launch(
        cls, build: Callable[[], LLMEngine], max_waiting_sequences: int | None = None
    ) -> AsyncLLM:
        """Build the engine on the thread that will step it, and return once it is built
        (`start()` then starts the stepping).  Whatever `build` raises is raised here."""
        built: concurrent.futures.Future[AsyncLLM] = concurrent.futures.Future()
        go = threading.Event()

        def engine_thread() -> None:
            try:
                owner = cls(build(), max_waiting_sequences)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                built.set_exception(exc)
                return
            owner._thread, owner._go = threading.current_thread(), go
            built.set_result(owner)
            go.wait()
            owner._run()

        threading.Thread(target=engine_thread, name=ENGINE_THREAD, daemon=True).start()
        return built.result()

    def _stalled(self, error: EngineStalledError) -> None:
        """The watchdog's verdict (its thread): unhealthy now, and the process is told to
        exit, since the engine thread may never come back to fail its requests itself."""
        logger.critical("%s", error)
        self._error = error
        if self.on_fatal is not None:
            self.on_fatal(error)

    def _fail_from_outside(self, error: BaseException) -> None:
        """A tensor-parallel rank died (any thread): unhealthy at once, and the engine thread
        stops at its next turn (or as soon as its step's collective fails)."""
        self._error = error
        self._wakeup.set()

    def start(self, stall_timeout_s: float = 0.0) -> None:
        """Start the engine thread (and, when `stall_timeout_s` > 0, its watchdog: see
        watchdog.py); the calling thread (the server's event loop, and the tokenizer threads
        it starts later) then moves off the compute CPUs when --cpu-threads-bind reserves
        some for it."""
        if stall_timeout_s > 0:
            self._watchdog = StallWatchdog(stall_timeout_s, self._stalled)
            self._watchdog.start()
        if self._go is not None:
            self._go.set()
        else:
            self._thread.start()
        bind_server_threads(self.engine.cpu_threads)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping and self._error is None

    @property
    def error(self) -> BaseException | None:
        """Why the engine thread stopped on its own; None while it runs or after shutdown."""
        return self._error

    # ------------------------------------------------------------------ event-loop side
    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        on_output: Callable[[RequestOutput], None] | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        kv_retention_priority: int = DEFAULT_RETENTION_PRIORITY,
    ) -> RequestStream:
        """Add a request now and return the stream of its outputs.

        Raises ValueError (and nothing was added) for a request the engine rejects, so a
        server can answer 400 before it commits to a streaming response; QueueFullError when
        max_waiting_sequences are already waiting.  The caller must
        close the returned stream (``async with`` or ``close()``) unless it reads it to the
        end: closing an unfinished stream aborts the request and frees its blocks."""
        stream = _Stream(asyncio.get_running_loop(), OutputCollector(params.output_kind))
        try:
            await self._submit(
                lambda: self._add(
                    request_id, prompt, params, stream, cache_salt, priority, kv_retention_priority
                )  # fmt: skip
            )
        except asyncio.CancelledError:
            self.abort(request_id)  # the add may have happened before the cancel arrived
            raise
        return RequestStream(self, request_id, stream.collector, on_output)

    async def generate(
        self, request_id: str, prompt: str | list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """`add_request` + iterate: yields outputs (of params.output_kind) until the request
        finishes."""
        async with await self.add_request(request_id, prompt, params) as outputs:
            async for output in outputs:
                yield output

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op when unknown or finished).  Safe from any thread, and from a
        `finally` of a cancelled task: it only enqueues the command."""
        with self._lock:
            if not self._closed:
                self._commands.put((lambda: self._abort(request_id), concurrent.futures.Future()))
        self._wakeup.set()

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run `fn(engine)` on the engine thread and return its result (for rare, quick
        calls such as diagnostics)."""
        return await self._submit(lambda: fn(self.engine))

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine thread after its current step; requests still running get
        EngineDeadError."""
        self._stopping = True
        self._wakeup.set()
        if self._watchdog is not None:
            self._watchdog.stop()
        if self._go is not None:
            self._go.set()  # launched but never started: let _run close the engine and end
        if isinstance(self._error, EngineStalledError):
            return  # stuck for good: waiting for it would only delay the exit
        if self._thread.is_alive():
            self._thread.join(timeout)

    async def _submit(self, fn: Callable[[], Any]) -> Any:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closed or self._stopping or not self._thread.is_alive():
                raise EngineDeadError("the engine is not running")
            self._commands.put((fn, future))
        self._wakeup.set()
        return await asyncio.wrap_future(future)

    # ------------------------------------------------------------------ engine thread
    def _add(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        stream: _Stream,
        cache_salt: str | None,
        priority: int,
        kv_retention_priority: int,
    ) -> None:
        limit = self.max_waiting_sequences
        if limit is not None and self.engine.num_waiting_sequences + params.n > limit:
            raise QueueFullError(self.engine.num_waiting_sequences, limit)
        # ValueError: nothing was added
        self.engine.add_request(request_id, prompt, params, cache_salt=cache_salt,
                                priority=priority,
                                kv_retention_priority=kv_retention_priority)  # fmt: skip
        self._streams[request_id] = stream

    def _abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)
        self._streams.pop(request_id, None)

    def _run(self) -> None:
        try:
            bind_compute_threads(self.engine.cpu_threads)  # this thread's own team
            with heap_frozen():  # no collection walks the engine's own objects (gc_freeze.py)
                self._serve()
        except BaseException as exc:  # noqa: BLE001 - anything here ends the engine
            logger.exception("engine thread failed; no more requests can be served")
            self._error = exc
        finally:
            self._fail_all(EngineDeadError("the engine stopped before the request finished"))
            self._close_engine()
        if self._error is not None and self.on_fatal is not None:
            self.on_fatal(self._error)

    def _serve(self) -> None:
        """Commands and steps until the server stops."""
        while not self._stopping:
            if self._error is not None:
                raise self._error
            self._run_commands()
            if not self.engine.has_unfinished_requests():
                self.stats = self.engine.get_stats()
                self._wakeup.wait()
                self._wakeup.clear()
                self._run_commands()
                if self.engine.has_unfinished_requests():
                    self._gather_burst()
                continue
            self._step()

    def _gather_burst(self) -> None:
        """Run the commands that keep arriving, each within BURST_GAP_S of the last, for up to
        BURST_WINDOW_S (see there)."""
        deadline = time.monotonic() + BURST_WINDOW_S
        while not self._stopping and time.monotonic() < deadline:
            if not self._wakeup.wait(timeout=BURST_GAP_S):
                return
            self._wakeup.clear()
            self._run_commands()

    def _close_engine(self) -> None:
        """Write the prefix cache store, stop the event publisher (after the requests were
        failed, so nothing changes the cache any more).  Not after an engine failure: its
        blocks are not to be trusted, and the process is about to exit anyway."""
        if self._error is not None:
            return
        try:
            self.engine.close()
        except Exception:  # noqa: BLE001 - going down: log, never mask the first error
            logger.exception("closing the engine failed")

    def _run_commands(self) -> None:
        while True:
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if not future.set_running_or_notify_cancel():
                continue
            self._begin("a command")
            try:
                future.set_result(fn())
            except Exception as exc:  # the caller gets it (e.g. ValueError for a bad request)
                future.set_exception(exc)
            finally:
                self._end()

    def _begin(self, what: str) -> None:
        if self._watchdog is not None:
            self._watchdog.begin(what)

    def _end(self) -> None:
        if self._watchdog is not None:
            self._watchdog.end()

    def _step(self) -> None:
        self._begin("a step")
        try:
            outputs = self.engine.step()
        except StepFailedError as exc:
            self._fail_requests(exc)
            return
        finally:
            self._end()
        self._consecutive_failures = 0
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
            stream.put(output)
        self.stats = self.engine.get_stats()

    def _fail_requests(self, exc: StepFailedError) -> None:
        """The step's requests were aborted by the engine: end their streams with a 500-kind
        error; re-raise (ending the engine) when steps keep failing."""
        self._consecutive_failures += 1
        logger.error(
            "engine step failed (%d in a row); failing its %d request(s) %s",
            self._consecutive_failures, len(exc.request_ids), exc.request_ids[:8],
            exc_info=exc.cause,
        )  # fmt: skip
        for request_id in exc.request_ids:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.put(RequestFailedError(f"the engine step computing this request failed "
                                              f"({exc}); it was aborted"))  # fmt: skip
        self.stats = self.engine.get_stats()
        if self._consecutive_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
            raise RuntimeError(
                f"{self._consecutive_failures} engine steps failed in a row; the last: {exc}"
            ) from exc

    def _fail_all(self, error: BaseException) -> None:
        for request_id, stream in list(self._streams.items()):
            stream.put(error)
            try:
                self.engine.abort_request(request_id)
            except Exception:  # noqa: BLE001 - best effort while going down
                logger.exception("could not abort %s", request_id)
        self._streams.clear()
        with self._lock:
            self._closed = True
        while True:  # commands that will never run: wake their callers
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineDeadError("the engine is not running"))


@dataclass(eq=False)
class RequestStream:
    """Async iterator over one request's outputs; closing it early aborts.  A reader that fell
    behind gets what it missed in one output (the newest cumulative one, or the deltas
    merged)."""

    _owner: AsyncLLM
    request_id: str
    _pending: OutputCollector
    _on_output: Callable[[RequestOutput], None] | None
    _done: bool = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._pending.get()
        except asyncio.CancelledError:
            self.close()  # cancelled while waiting: the client is gone
            raise
        except BaseException:
            self._done = True  # the engine already dropped the request
            raise
        self._done = item.finished
        if self._on_output is not None:
            self._on_output(item)
        return item

    def close(self) -> None:
        """Abort the request unless it finished; idempotent."""
        if not self._done:
            self._done = True
            self._owner.abort(self.request_id)

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()
