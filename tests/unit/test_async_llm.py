"""AsyncLLM against a fake engine (no model, milliseconds): outputs reach the right request,
a rejected request leaves nothing behind, leaving early aborts, a failed step fails only its
own requests, repeated failures or an error outside a step end every stream with
EngineDeadError (never a hang) and call on_fatal, a full queue refuses with QueueFullError.
The server's e2e tests cover the rest."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvserve.engine.async_llm import (
    MAX_CONSECUTIVE_STEP_FAILURES,
    AsyncLLM,
    EngineDeadError,
    OutputCollector,
)
from kvserve.engine.llm_engine import StepFailedError
from kvserve.engine.watchdog import EngineStalledError
from kvserve.errors import QueueFullError, RequestFailedError
from kvserve.request import RequestOutputKind, SamplingParams
from kvserve.step import CompletionOutput, RequestOutput, SchedulerStats


class FakeEngine:
    """One token per step per request (token = step count); asserts it runs on one thread."""

    def __init__(self, fail_at_step: int | None = None) -> None:
        self.requests: dict[str, tuple[list[int], int]] = {}  # id -> (tokens, max_tokens)
        self.aborted: list[str] = []
        self.fail_at_step = fail_at_step
        self.poisoned: set[str] = set()  # a step with one of these fails (as LLMEngine does)
        self.num_waiting_sequences = 0
        self.num_steps = 0
        self.threads: set[int] = set()
        self.cpu_threads = None  # LLMEngine's thread plan: None leaves threads where they are

    def _touch(self) -> None:
        self.threads.add(threading.get_ident())

    def add_request(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        priority: int = 0,
        kv_retention_priority: int = 35,
    ) -> None:
        self._touch()
        if not prompt:
            raise ValueError("prompt must not be empty")
        self.requests[request_id] = ([], params.max_tokens or 1)

    def abort_request(self, request_id: str) -> None:
        self._touch()
        if self.requests.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def close(self) -> None:  # the engine thread's last call (writes the prefix cache store)
        self._touch()

    def on_executor_failure(self, callback) -> None:
        self.executor_failed = callback  # a test calls it as a dying rank's monitor would

    def get_stats(self) -> SchedulerStats:
        return SchedulerStats(len(self.requests), 0, 0.0, 0, 0, 0, 0, 0.0)

    def step(self) -> list[RequestOutput]:
        self._touch()
        self.num_steps += 1
        if self.num_steps == self.fail_at_step:
            raise RuntimeError("injected failure")
        bad = sorted(self.poisoned & self.requests.keys())
        if bad:
            for request_id in bad:  # LLMEngine aborts the step's requests, then raises
                self.abort_request(request_id)
            raise StepFailedError(bad, RuntimeError("injected step failure"))
        outputs = []
        for request_id, (tokens, max_tokens) in list(self.requests.items()):
            tokens.append(self.num_steps)
            done = len(tokens) >= max_tokens
            completion = CompletionOutput(0, "", list(tokens), "length" if done else None)
            outputs.append(RequestOutput(request_id, None, [1], [completion], done))
            if done:
                del self.requests[request_id]
        return outputs


def run_with(engine: FakeEngine, scenario, **kwargs) -> None:
    llm = AsyncLLM(engine, **kwargs)  # type: ignore[arg-type]
    llm.start()
    try:
        asyncio.run(asyncio.wait_for(scenario(llm), timeout=10))
    finally:
        llm.shutdown()


def test_concurrent_requests_get_their_own_outputs():
    engine = FakeEngine()

    async def scenario(llm: AsyncLLM) -> None:
        async def one(request_id: str, max_tokens: int) -> list[int]:
            last = None
            async for output in llm.generate(
                request_id, [1], SamplingParams(max_tokens=max_tokens)
            ):
                last = output
            assert last is not None and last.finished and last.request_id == request_id
            return last.outputs[0].token_ids

        lengths = [1, 3, 5, 8]
        results = await asyncio.gather(*(one(f"r{n}", n) for n in lengths))
        assert [len(r) for r in results] == lengths

    run_with(engine, scenario)
    assert len(engine.threads) == 1 and threading.get_ident() not in engine.threads
    assert engine.aborted == []


def test_rejected_request_raises_and_leaves_nothing():
    engine = FakeEngine()

    async def scenario(llm: AsyncLLM) -> None:
        with pytest.raises(ValueError, match="empty"):
            await llm.add_request("bad", [], SamplingParams())
        assert llm._streams == {}  # noqa: SLF001 - engine-thread state, quiescent here

    run_with(engine, scenario)
    assert engine.requests == {}


def test_leaving_a_stream_early_aborts_the_request():
    engine = FakeEngine()

    async def scenario(llm: AsyncLLM) -> None:
        stream = await llm.add_request("long", [1], SamplingParams(max_tokens=10_000))
        async with stream:
            await stream.__anext__()
        for _ in range(100):
            if "long" in engine.aborted:
                return
            await asyncio.sleep(0.01)

    run_with(engine, scenario)
    assert engine.aborted == ["long"] and engine.requests == {}


def test_a_failing_step_ends_streams_with_engine_dead_error():
    engine = FakeEngine(fail_at_step=3)

    async def scenario(llm: AsyncLLM) -> None:
        with pytest.raises(EngineDeadError):
            async for _ in llm.generate("r", [1], SamplingParams(max_tokens=100)):
                pass
        assert not llm.is_running
        with pytest.raises(EngineDeadError):
            await llm.add_request("later", [1], SamplingParams())

    run_with(engine, scenario)


async def _finish(llm: AsyncLLM, request_id: str, max_tokens: int) -> RequestOutput:
    last = None
    async for output in llm.generate(request_id, [1], SamplingParams(max_tokens=max_tokens)):
        last = output
    assert last is not None
    return last


def test_a_failed_step_fails_only_its_requests_and_the_engine_goes_on():
    engine = FakeEngine()
    engine.poisoned.add("bad")

    async def scenario(llm: AsyncLLM) -> None:
        good = asyncio.create_task(_finish(llm, "good", 20))
        await asyncio.sleep(0.05)
        with pytest.raises(RequestFailedError, match="injected step failure"):
            await _finish(llm, "bad", 20)
        assert (await good).finished and len((await good).outputs[0].token_ids) == 20
        assert llm.is_running and llm.error is None
        assert len((await _finish(llm, "later", 3)).outputs[0].token_ids) == 3

    run_with(engine, scenario)
    assert "bad" in engine.aborted and engine.requests == {}


def test_repeated_step_failures_stop_the_engine_and_call_on_fatal():
    engine = FakeEngine()
    engine.poisoned.update(f"bad{i}" for i in range(MAX_CONSECUTIVE_STEP_FAILURES))
    fatal: list[BaseException] = []

    async def scenario(llm: AsyncLLM) -> None:
        for i in range(MAX_CONSECUTIVE_STEP_FAILURES - 1):
            with pytest.raises(RequestFailedError):
                await _finish(llm, f"bad{i}", 5)
            assert llm.is_running
        with pytest.raises(RequestFailedError):
            await _finish(llm, f"bad{MAX_CONSECUTIVE_STEP_FAILURES - 1}", 5)
        for _ in range(100):
            if fatal:
                break
            await asyncio.sleep(0.01)
        assert not llm.is_running and "in a row" in str(llm.error)
        with pytest.raises(EngineDeadError):
            await llm.add_request("later", [1], SamplingParams())

    run_with(engine, scenario, on_fatal=fatal.append)
    assert len(fatal) == 1


def test_a_failure_outside_a_step_calls_on_fatal():
    engine = FakeEngine(fail_at_step=2)
    fatal: list[BaseException] = []

    async def scenario(llm: AsyncLLM) -> None:
        with pytest.raises(EngineDeadError):
            await _finish(llm, "r", 100)

    run_with(engine, scenario, on_fatal=fatal.append)
    assert [str(e) for e in fatal] == ["injected failure"]


@pytest.mark.parametrize("busy", [False, True])
def test_a_dead_rank_makes_the_engine_unhealthy_at_once_and_calls_on_fatal(busy):
    """The tensor-parallel monitor reports a dead rank from its own thread, while a request
    streams or while the engine thread sleeps with nothing to do."""
    engine = FakeEngine()
    fatal: list[BaseException] = []
    death = RuntimeError("tensor-parallel worker rank 1 died (pid 7, killed by signal 9)")

    async def scenario(llm: AsyncLLM) -> None:
        stream = await llm.add_request("r", [1], SamplingParams(max_tokens=10**6)) if busy else None
        await asyncio.sleep(0.05)
        assert llm.is_running
        engine.executor_failed(death)
        assert not llm.is_running  # /health answers 503 from now on
        if stream is not None:
            with pytest.raises(EngineDeadError):
                async for _ in stream:
                    pass
        for _ in range(100):
            if fatal:
                break
            await asyncio.sleep(0.01)

    run_with(engine, scenario, on_fatal=fatal.append)
    assert fatal == [death]


def test_a_full_waiting_queue_refuses_new_requests():
    engine = FakeEngine()
    engine.num_waiting_sequences = 3

    async def scenario(llm: AsyncLLM) -> None:
        await (await llm.add_request("fits", [1], SamplingParams(max_tokens=1))).aclose()
        with pytest.raises(QueueFullError, match="4 sequences are waiting, the limit is 4"):
            engine.num_waiting_sequences = 4
            await llm.add_request("over", [1], SamplingParams(n=1))
        engine.num_waiting_sequences = 3
        with pytest.raises(QueueFullError):  # n counts: 3 waiting + 2 samples > 4
            await llm.add_request("n2", [1], SamplingParams(n=2))

    run_with(engine, scenario, max_waiting_sequences=4)
    assert "over" not in engine.requests and "n2" not in engine.requests


def test_launch_builds_the_engine_on_the_thread_that_steps_it():
    """One thread runs every torch op: a second thread's OpenMP team would throttle libgomp's
    barrier spinning (see AsyncLLM.launch)."""
    built_on: list[int] = []

    def build() -> FakeEngine:
        built_on.append(threading.get_ident())
        return FakeEngine()

    llm = AsyncLLM.launch(build)  # type: ignore[arg-type, return-value]
    assert built_on and built_on[0] != threading.get_ident()
    assert llm.engine.num_steps == 0  # nothing steps before start()
    llm.start()
    try:

        async def scenario() -> list[int]:
            outputs = [o async for o in llm.generate("r", [1], SamplingParams(max_tokens=3))]
            return outputs[-1].outputs[0].token_ids

        assert asyncio.run(asyncio.wait_for(scenario(), timeout=10)) == [1, 2, 3]
    finally:
        llm.shutdown()
    assert llm.engine.threads == set(built_on)  # add, steps and close: the building thread


def test_launch_raises_what_the_build_raises():
    def build() -> FakeEngine:
        raise ValueError("--kv-cache-memory: too small")

    with pytest.raises(ValueError, match="kv-cache-memory"):
        AsyncLLM.launch(build)  # type: ignore[arg-type]


def test_a_launched_engine_shut_down_before_start_is_closed_on_its_thread():
    llm = AsyncLLM.launch(FakeEngine)  # type: ignore[arg-type]
    llm.shutdown()
    assert not llm._thread.is_alive()
    assert len(llm.engine.threads) == 1 and threading.get_ident() not in llm.engine.threads


class StepSizeEngine(FakeEngine):
    """Records how many requests each step ran."""

    def __init__(self) -> None:
        super().__init__()
        self.step_sizes: list[int] = []

    def step(self) -> list[RequestOutput]:
        self.step_sizes.append(len(self.requests))
        return super().step()


@pytest.mark.parametrize(("gap_s", "window_s", "first_step"), [(0.5, 5.0, 8), (0.5, 0.0, 1)])
def test_an_idle_engine_takes_a_burst_of_requests_into_its_first_step(
    monkeypatch, gap_s, window_s, first_step
):
    """Requests arriving 20 ms apart into an idle engine: with a burst gap longer than that,
    the first step runs all eight (W3's prompts then share one full step); with no burst
    window, the first request steps alone.  The gaps are wide so that a slow CI machine
    cannot change the outcome."""
    from kvserve.engine import async_llm

    monkeypatch.setattr(async_llm, "BURST_GAP_S", gap_s)
    monkeypatch.setattr(async_llm, "BURST_WINDOW_S", window_s)
    engine = StepSizeEngine()

    async def scenario(llm: AsyncLLM) -> None:
        streams = []
        for i in range(8):
            streams.append(await llm.add_request(f"r{i}", [1], SamplingParams(max_tokens=2)))
            await asyncio.sleep(0.02)
        for stream in streams:
            async for _ in stream:
                pass

    run_with(engine, scenario)
    assert engine.step_sizes[0] == first_step


class DeltaEngine(FakeEngine):
    """FakeEngine whose outputs are deltas (one new token, one character a step), as the
    server asks for them (RequestOutputKind.DELTA)."""

    def step(self) -> list[RequestOutput]:
        outputs = super().step()
        for output in outputs:
            completion = output.outputs[0]
            completion.token_ids = completion.token_ids[-1:]
            completion.text = "x"
        return outputs


def test_a_reader_that_falls_behind_gets_the_missed_deltas_merged_in_bounded_memory():
    """A client that stops reading must not make the server queue every step's output: the
    collector holds one chunk per OutputCollector.CHUNK steps, and the reader then gets every
    token exactly once, in order."""
    engine = DeltaEngine()
    delta = SamplingParams(max_tokens=1000, output_kind=RequestOutputKind.DELTA)

    async def scenario(llm: AsyncLLM) -> None:
        stream = await llm.add_request("slow", [1], delta)
        async with stream:
            first = await stream.__anext__()
            while engine.num_steps < 600:  # the reader stops reading for 600 steps
                await asyncio.sleep(0.01)
            collector = stream._pending  # noqa: SLF001 - what the request holds meanwhile
            held = len(collector._chunks) + len(collector._recent)  # noqa: SLF001
            steps = engine.num_steps  # read after: the engine thread steps on meanwhile
            assert held <= steps // OutputCollector.CHUNK + OutputCollector.CHUNK
            token_ids, text = list(first.outputs[0].token_ids), first.outputs[0].text
            async for output in stream:
                token_ids += output.outputs[0].token_ids
                text += output.outputs[0].text
        assert token_ids == list(range(1, 1001)) and text == "x" * 1000

    run_with(engine, scenario)


def test_a_cumulative_reader_that_falls_behind_gets_only_the_newest_output():
    engine = FakeEngine()

    async def scenario(llm: AsyncLLM) -> None:
        stream = await llm.add_request("slow", [1], SamplingParams(max_tokens=300))
        async with stream:
            while engine.num_steps < 200:
                await asyncio.sleep(0.01)
            outputs = [output async for output in stream]
        assert outputs[-1].outputs[0].token_ids == list(range(1, 301))
        assert len(outputs) < 100  # not one per step

    run_with(engine, scenario)


class HangingEngine(FakeEngine):
    """A step of request "hang" never returns (a collective whose peer hangs)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def step(self) -> list[RequestOutput]:
        if "hang" in self.requests:
            self.release.wait()
        return super().step()


def test_a_step_that_never_returns_is_reported_by_the_watchdog():
    engine = HangingEngine()
    fatal: list[BaseException] = []
    llm = AsyncLLM(engine, on_fatal=fatal.append)  # type: ignore[arg-type]
    llm.start(stall_timeout_s=0.3)

    async def scenario() -> None:
        assert len((await _finish(llm, "fine", 20)).outputs[0].token_ids) == 20
        assert llm.is_running and not fatal  # many short steps are no stall
        await llm.add_request("hang", [1], SamplingParams(max_tokens=5))
        for _ in range(300):
            if fatal:
                break
            await asyncio.sleep(0.01)

    try:
        asyncio.run(asyncio.wait_for(scenario(), timeout=10))
        assert len(fatal) == 1 and isinstance(fatal[0], EngineStalledError)
        assert "in a step" in str(fatal[0]) and "release.wait" in str(fatal[0])  # its stack
        assert not llm.is_running and llm.error is fatal[0]
    finally:
        llm.shutdown()  # returns at once: the engine thread is stuck for good
        engine.release.set()
