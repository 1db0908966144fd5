"""The engine-core process and its client: the core loop's message handling (a fake engine over inproc
sockets, milliseconds), and the process's life (real engine): startup failure, the core dying under the
API process, the API process dying under the core."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import psutil
import pytest
import zmq

from hearth.engine.async_engine import AsyncEngine, EngineCoreError
from hearth.engine.config import EngineConfig
from hearth.engine.core_process import EngineCoreLoop
from hearth.engine.messages import (
    AbortRequests,
    CoreOutput,
    CoreOutputs,
    EngineRequest,
    EngineStats,
    ShutdownCore,
)
from hearth.engine.sampling_params import InvalidParamError, SamplingParams

# ---- the core loop, with a fake engine ----------------------------------------------------------------


class FakeEngine:
    """One page per running request; each step gives every request the token `100 + its step count`."""

    has_kv_connectors = False  # nothing arrives from a tier or a peer here
    only_waiting_for_kv = False

    def __init__(self) -> None:
        self.running: dict[str, tuple[EngineRequest, int]] = {}
        self.fail_next_step = False
        self.steps = 0

    @property
    def has_work(self) -> bool:
        return bool(self.running)

    def add_request(self, request: EngineRequest) -> None:
        if not request.prompt_token_ids:
            raise InvalidParamError("prompt", "the prompt is empty")
        if request.request_id in self.running:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.running[request.request_id] = (request, 0)

    def abort(self, request_ids: list[str], reason: str = "aborted") -> list[CoreOutput]:
        outputs = []
        for request_id in request_ids:
            if self.running.pop(request_id, None) is not None:
                outputs.append(CoreOutput(request_id, [], 1, 0, finish_reason="abort", error=reason))
        return outputs

    def step(self) -> list[CoreOutput]:
        self.steps += 1
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("the model exploded")
        outputs = []
        for request_id, (request, done) in list(self.running.items()):
            done += 1
            finished = done >= (request.params.max_tokens or 1)
            outputs.append(
                CoreOutput(request_id, [100 + done], 1, 0, finish_reason="length" if finished else None)
            )
            if finished:
                del self.running[request_id]
            else:
                self.running[request_id] = (request, done)
        time.sleep(0.001)
        return outputs

    def stats(self) -> EngineStats:
        n = len(self.running)
        return EngineStats(n, 0, n, 8, 0, 0, 0, 0, self.steps, 0)


class CoreHarness:
    """An `EngineCoreLoop` on a thread, and the API side's two sockets."""

    def __init__(self, engine: FakeEngine) -> None:
        self.context = zmq.Context()
        self.to_core = self.context.socket(zmq.PUSH)
        self.to_core.bind("inproc://to-core")
        self.from_core = self.context.socket(zmq.PULL)
        self.from_core.bind("inproc://from-core")
        inbox = self.context.socket(zmq.PULL)
        inbox.connect("inproc://to-core")
        outbox = self.context.socket(zmq.PUSH)
        outbox.connect("inproc://from-core")
        self.loop = EngineCoreLoop(engine, inbox, outbox)  # type: ignore[arg-type]
        self.thread = threading.Thread(target=self.loop.run, daemon=True)
        self.thread.start()
        self._sockets = [inbox, outbox]
        self._decoder = msgspec.msgpack.Decoder(CoreOutputs)

    def send(self, message: object) -> None:
        self.to_core.send(msgspec.msgpack.encode(message))

    def receive(self, timeout_s: float = 5.0) -> CoreOutputs:
        assert self.from_core.poll(int(timeout_s * 1000)), "no message from the core loop"
        return self._decoder.decode(self.from_core.recv())

    def outputs_until(self, done: set[str], timeout_s: float = 5.0) -> dict[str, list[CoreOutput]]:
        """Every output per request until each request in `done` has finished."""
        seen: dict[str, list[CoreOutput]] = {}
        deadline = time.monotonic() + timeout_s
        while not all(seen.get(rid) and seen[rid][-1].finished for rid in done):
            assert time.monotonic() < deadline, seen
            for output in self.receive().outputs:
                seen.setdefault(output.request_id, []).append(output)
        return seen

    def close(self) -> None:
        if self.thread.is_alive():
            self.send(ShutdownCore())
            self.thread.join(5)
        for sock in [self.to_core, self.from_core, *self._sockets]:
            sock.close(linger=0)
        self.context.term()


@pytest.fixture
def core() -> Iterator[tuple[CoreHarness, FakeEngine]]:
    engine = FakeEngine()
    harness = CoreHarness(engine)
    yield harness, engine
    harness.close()


def _request(request_id: str, max_tokens: int = 3, prompt: list[int] | None = None) -> EngineRequest:
    return EngineRequest(
        request_id, [1, 2] if prompt is None else prompt, SamplingParams(max_tokens=max_tokens)
    )


def test_core_loop_streams_each_step_and_reports_stats(core) -> None:
    harness, _ = core
    harness.send(_request("a", max_tokens=3))
    harness.send(_request("b", max_tokens=5))
    seen = harness.outputs_until({"a", "b"})
    assert [o.new_token_ids for o in seen["a"]] == [[101], [102], [103]]
    assert [o.finish_reason for o in seen["b"]] == [None] * 4 + ["length"]
    # every message carries the stats as of its end: once idle, nothing runs and no page is used
    idle = harness.loop.engine.stats()
    assert idle.num_running == 0 and idle.kv_pages_used == 0


def test_a_rejected_add_is_answered_with_the_param_and_the_rest_runs(core) -> None:
    harness, _ = core
    harness.send(_request("empty", prompt=[]))
    harness.send(_request("fine", max_tokens=2))
    seen = harness.outputs_until({"empty", "fine"})
    (rejected,) = seen["empty"]
    assert rejected.rejected_param == "prompt" and rejected.error == "the prompt is empty"
    assert rejected.new_token_ids == [] and rejected.finished
    assert seen["fine"][-1].finish_reason == "length"


def test_a_duplicate_id_fails_that_add_without_a_param(core) -> None:
    harness, _ = core
    harness.send(_request("dup", max_tokens=50))
    harness.send(_request("dup", max_tokens=50))
    answer = None
    while answer is None:
        answer = next((o for o in harness.receive().outputs if o.finish_reason == "error"), None)
    assert answer.rejected_param is None and "already in use" in (answer.error or "")
    harness.send(AbortRequests(["dup"]))


def test_abort_frees_the_request_and_the_next_message_says_so(core) -> None:
    harness, engine = core
    harness.send(_request("long", max_tokens=10_000))
    first = harness.receive()
    assert first.outputs[0].request_id == "long" and first.stats is not None
    harness.send(AbortRequests(["long"], "client left"))
    while True:
        message = harness.receive()
        aborted = [o for o in message.outputs if o.finish_reason == "abort"]
        if aborted:
            break
    assert aborted[0].error == "client left"
    assert message.stats is not None and message.stats.kv_pages_used == 0 and message.stats.num_running == 0
    assert not engine.running


def test_a_failed_step_fails_the_running_requests_and_the_core_keeps_serving(core) -> None:
    harness, engine = core
    harness.send(_request("x", max_tokens=10_000))
    harness.receive()
    engine.fail_next_step = True
    seen = harness.outputs_until({"x"})
    assert seen["x"][-1].finish_reason == "error" and "the model exploded" in (seen["x"][-1].error or "")
    harness.send(_request("after", max_tokens=2))
    assert harness.outputs_until({"after"})["after"][-1].finish_reason == "length"


def test_shutdown_aborts_what_runs_sends_it_and_ends_the_loop(core) -> None:
    harness, _ = core
    harness.send(_request("running", max_tokens=10_000))
    harness.receive()
    harness.send(ShutdownCore("bye"))
    harness.thread.join(5)
    assert not harness.thread.is_alive()
    last = None
    while harness.from_core.poll(100):
        last = harness._decoder.decode(harness.from_core.recv())
    assert last is not None
    assert [(o.request_id, o.finish_reason, o.error) for o in last.outputs] == [("running", "abort", "bye")]


# ---- the real process -------------------------------------------------------------------------------


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _gone(pid):
            return True
        time.sleep(0.05)
    return False


def test_a_model_that_fails_to_load_raises_its_reason_and_leaves_no_process(tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    before = {child.pid for child in psutil.Process().children()}
    with pytest.raises(EngineCoreError, match="config.json"):  # the core's reason, not the tokenizer's
        AsyncEngine(EngineConfig(model=str(broken)))
    for child in psutil.Process().children():
        assert child.pid in before or _wait_gone(child.pid, 10)


async def test_when_the_core_dies_streams_end_with_the_reason_and_nothing_hangs(tiny_llama) -> None:
    deaths: list[str] = []
    engine = AsyncEngine(
        EngineConfig(model=str(tiny_llama), dtype="float32", page_size=4), on_dead=deaths.append
    )
    try:
        params = SamplingParams(temperature=0, max_tokens=engine.max_model_len - 10, ignore_eos=True)
        outputs = []

        async def consume() -> None:
            async for output in engine.generate(list(range(5, 15)), params, "doomed"):
                outputs.append(output)
                if len(outputs) == 2:
                    os.kill(engine.core_pid, signal.SIGKILL)

        await asyncio.wait_for(consume(), 30)
        assert outputs[-1].finish_reason == "abort"
        assert "engine core process was killed by SIGKILL" in (outputs[-1].error or "")
        assert engine.dead is not None and deaths == [engine.dead]
        # a new request ends at once, the same way
        late = [o async for o in engine.generate([1, 2, 3], params, "late")]
        assert len(late) == 1 and late[0].finish_reason == "abort" and late[0].error == engine.dead
    finally:
        started = time.monotonic()
        engine.shutdown()
        assert time.monotonic() - started < 5


def test_the_core_exits_when_the_api_process_is_killed(tiny_llama, tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import time
        from hearth.engine.async_engine import AsyncEngine
        from hearth.engine.config import EngineConfig
        engine = AsyncEngine(EngineConfig(model={str(tiny_llama)!r}, dtype="float32"))
        print(engine.core_pid, engine._ipc_dir, flush=True)
        time.sleep(600)
        """
    )
    api = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert api.stdout is not None
        core_pid_text, ipc_dir = api.stdout.readline().split()
        core_pid = int(core_pid_text)
        assert not _gone(core_pid)
        api.kill()
        api.wait(10)
        assert _wait_gone(core_pid, 10), "the engine core outlived its API process"
        assert not Path(ipc_dir).exists()
    finally:
        api.kill()
        api.wait()


async def test_the_core_ignores_sigint_so_the_api_process_can_drain(tiny_llama) -> None:
    engine = AsyncEngine(EngineConfig(model=str(tiny_llama), dtype="float32", page_size=4))
    try:
        os.kill(engine.core_pid, signal.SIGINT)
        os.kill(engine.core_pid, signal.SIGTERM)
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        outputs = [o async for o in engine.generate([5, 6, 7], params, "still-there")]
        assert outputs[-1].finish_reason == "length" and engine.dead is None
    finally:
        engine.shutdown()
    assert _wait_gone(engine.core_pid, 5)


class WaitingForKVEngine(FakeEngine):
    """One request parked in WAITING_FOR_KV: the engine has work, but nothing can run until KV arrives."""

    has_kv_connectors = True
    only_waiting_for_kv = True
    has_runnable_work = False

    @property
    def has_work(self) -> bool:
        return True

    def step(self) -> list[CoreOutput]:
        self.steps += 1
        return []


def test_core_loop_waits_instead_of_spinning_while_only_kv_loads_are_pending() -> None:
    engine = WaitingForKVEngine()
    harness = CoreHarness(engine)
    try:
        time.sleep(0.5)
        steps = engine.steps
    finally:
        harness.close()
    # A 1 ms wait per pass: at most ~500 steps; a spinning loop makes tens of thousands.
    assert 0 < steps <= 600
