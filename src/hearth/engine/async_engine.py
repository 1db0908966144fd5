"""`AsyncEngine`: the API process's side of `hearth serve`; the engine core runs in a process of its own.

The engine core (hearth.engine.core_process: scheduler, KV cache, model) steps in its own process, so a
step never waits for the event loop's Python and the event loop never waits for a step (they shared one
GIL when the engine was a thread here). This side keeps the tokenizer and an `OutputProcessor`
(detokenization, stop strings, logprobs): it sends `EngineRequest`s and aborts, and reads one
`CoreOutputs` message per engine step on the event loop itself: the output socket's file descriptor is
watched by the loop, so no reader thread has to wake and hand the GIL over for every step.

The sockets are ipc:// files in a private temporary directory; nothing leaves the machine. If the core
process dies, every stream ends with an "abort" output that says so, new requests get one at once,
`dead` says why, and `on_dead` is called (the server exits non-zero).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import AsyncIterator, Callable

import msgspec
import zmq

from hearth.engine.config import EngineConfig
from hearth.engine.memory_defaults import CORE_MEMORY_ENVIRONMENT, memory_defaults_enabled
from hearth.engine.messages import (
    AbortRequests,
    CoreFailed,
    CoreOutput,
    CoreOutputs,
    CoreReady,
    EngineRequest,
    EngineStats,
    FromCore,
    KVTransferParams,
    ShutdownCore,
)
from hearth.engine.output_processor import OutputProcessor
from hearth.engine.outputs import RequestOutput
from hearth.engine.sampling_params import InvalidParamError, SamplingParams
from hearth.model.tokenizer import Tokenizer

logger = logging.getLogger("hearth.engine")

READY_POLL_MS = 100


class EngineCoreError(RuntimeError):
    """The engine core could not start; the message says why (the model's load error, or how it exited)."""


class AsyncEngine:
    """Streams each request's outputs from the engine-core process to asyncio consumers.

    `generate` and `abort` run on an event loop (one at a time: the loop that calls `generate` is the one
    that reads the core's outputs); `stats()` returns the latest stats the core pushed. `shutdown()` stops
    the core (running requests end with "abort") and waits for it to exit.
    """

    def __init__(self, config: EngineConfig, on_dead: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.dead: str | None = None  # why the engine core process is gone, once it is
        self._on_dead = on_dead
        self._closing = False
        self._ipc_dir = tempfile.mkdtemp(prefix="hearth-ipc-")
        to_core, from_core = f"ipc://{self._ipc_dir}/to-core", f"ipc://{self._ipc_dir}/from-core"
        self._zmq = zmq.Context(io_threads=1)
        self._to_core = self._zmq.socket(zmq.PUSH)
        self._to_core.setsockopt(zmq.SNDHWM, 0)  # never block the event loop or drop an abort
        self._to_core.bind(to_core)
        self._from_core = self._zmq.socket(zmq.PULL)
        self._from_core.setsockopt(zmq.RCVHWM, 0)
        self._from_core.bind(from_core)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(FromCore)
        self._send_lock = threading.Lock()  # shutdown() may run on another thread than the loop
        self._process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "hearth.engine.core_process",
                "--engine-config-json",
                msgspec.json.encode(config).decode(),
                "--input",
                to_core,
                "--output",
                from_core,
                "--parent-pid",
                str(os.getpid()),
                "--log-level-number",
                str(logging.getLogger().getEffectiveLevel()),
            ],
            stdin=subprocess.DEVNULL,
            env=_core_environment(),
            # Its own session: a terminal's Ctrl-C reaches only this process, which stops the core in
            # order (a SIGINT to both killed the core mid-import with a traceback while the model loaded).
            start_new_session=True,
        )
        logger.info(
            "engine core process started (pid %d, %d torch threads)",
            self._process.pid,
            config.resolved_num_threads,
        )
        try:
            tokenizer: Tokenizer | Exception
            try:
                tokenizer = Tokenizer.from_dir(config.tokenizer_dir)  # while the core loads the model
            except Exception as exc:  # the core's reason comes first if it fails too (a bad config.json)
                tokenizer = exc
            ready = self._wait_ready()
            if isinstance(tokenizer, Exception):
                raise tokenizer
        except BaseException:
            self._stop_core(timeout_s=0)
            self._close_sockets()
            raise
        self.tokenizer = tokenizer
        self.max_model_len = ready.max_model_len
        self.num_kv_tokens = ready.num_kv_tokens
        self.vocab_size = ready.vocab_size
        self.kv_transfer_endpoint = ready.kv_transfer_endpoint  # decode role: where prefill servers send KV
        self._stats: EngineStats = ready.stats
        self._processor = OutputProcessor(self.tokenizer)
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watcher = threading.Thread(target=self._watch_core, name="hearth-core-watch", daemon=True)
        self._watcher.start()

    @property
    def model_name(self) -> str:
        return self.config.model_name

    @property
    def core_pid(self) -> int:
        return self._process.pid

    def stats(self) -> EngineStats:
        return self._stats

    # ---- requests -------------------------------------------------------------------------------

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        cache_salt: str | None = None,
        kv_transfer: KVTransferParams | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields one output per engine step with new tokens; the last has `finish_reason`.

        A request the core rejects raises InvalidParamError before any output. Closing the iterator
        early aborts the request in the core, which frees its pages.
        """
        self._watch_loop()
        if self.dead is not None:
            yield self._dead_output(request_id, len(prompt_token_ids))
            return
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[request_id] = queue
        self._processor.add_request(request_id, prompt_token_ids, params)
        self._send(EngineRequest(request_id, prompt_token_ids, params, cache_salt, kv_transfer))
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finish_reason is not None
                yield item
                if finished:
                    return
        finally:
            if not finished:  # the consumer left early (client gone, error): end it in the core too
                self._streams.pop(request_id, None)
                self._processor.abort(request_id, "aborted by the client")
                self._send(AbortRequests([request_id], "aborted by the client"))

    async def abort(self, request_id: str, reason: str = "aborted by the client") -> None:
        """Ends the request's stream now with an "abort" output saying `reason`; the core frees its pages."""
        output = self._processor.abort(request_id, reason)
        queue = self._streams.pop(request_id, None)
        if queue is not None and output is not None:
            queue.put_nowait(output)
        self._send(AbortRequests([request_id], reason))

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stops the core (what still runs ends with "abort") and waits for it to exit; idempotent."""
        if self._closing:
            return
        self._closing = True
        self._stop_core(timeout_s)
        self._unwatch_loop()
        self._close_sockets()

    # ---- the event loop's side -----------------------------------------------------------------------

    def _send(self, message: EngineRequest | AbortRequests | ShutdownCore) -> None:
        if self.dead is not None or self._to_core.closed:
            return
        data = self._encoder.encode(message)
        with self._send_lock:
            self._to_core.send(data)

    def _watch_loop(self) -> None:
        """Reads the core's outputs on the calling event loop (moving off a previous loop, as tests do)."""
        loop = asyncio.get_running_loop()
        if loop is self._loop:
            return
        self._unwatch_loop()
        self._loop = loop
        loop.add_reader(self._from_core.getsockopt(zmq.FD), self._on_readable)
        loop.call_soon(self._on_readable)  # what arrived before the loop watched the socket

    def _unwatch_loop(self) -> None:
        loop, self._loop = self._loop, None
        if loop is None or loop.is_closed() or self._from_core.closed:
            return
        fd = self._from_core.getsockopt(zmq.FD)
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop or not loop.is_running():
            loop.remove_reader(fd)
            return
        done = threading.Event()

        def remove() -> None:
            loop.remove_reader(fd)
            done.set()

        loop.call_soon_threadsafe(remove)
        done.wait(5)

    def _on_readable(self) -> None:
        # The socket's fd only signals that its state changed: read until zmq says nothing is left.
        sock = self._from_core
        while not sock.closed and sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            message = self._decoder.decode(sock.recv(zmq.NOBLOCK))
            if not isinstance(message, CoreOutputs):
                logger.warning("unexpected message from the engine core: %s", type(message).__name__)
                continue
            if message.stats is not None:
                self._stats = message.stats
            if message.outputs:
                try:
                    self._dispatch(message.outputs)
                except Exception:  # a bug here must not stop the reading of later messages
                    logger.exception("could not process the engine's outputs")

    def _dispatch(self, outputs: list[CoreOutput]) -> None:
        streams = self._streams
        rejected = [output for output in outputs if output.rejected_param is not None]
        if rejected:
            for output in rejected:
                self._processor.abort(output.request_id, output.error or "rejected")
                queue = streams.pop(output.request_id, None)
                if queue is not None:
                    queue.put_nowait(
                        InvalidParamError(output.rejected_param or "", output.error or "rejected")
                    )
            outputs = [output for output in outputs if output.rejected_param is None]
        processed = self._processor.process(outputs)
        for request_output in processed.request_outputs:
            queue = streams.get(request_output.request_id)
            if queue is None:
                continue
            if request_output.finish_reason is not None:
                del streams[request_output.request_id]
            queue.put_nowait(request_output)
        if processed.abort_request_ids:  # stop strings ended them here; free their pages in the core
            self._send(AbortRequests(processed.abort_request_ids, "finished by a stop string"))

    # ---- the core process ----------------------------------------------------------------------------

    def _wait_ready(self) -> CoreReady:
        while True:
            if self._from_core.poll(READY_POLL_MS):
                message = self._decoder.decode(self._from_core.recv())
                if isinstance(message, CoreReady):
                    return message
                if isinstance(message, CoreFailed):
                    raise EngineCoreError(message.error)
                continue
            code = self._process.poll()
            if code is not None:
                raise EngineCoreError(
                    f"the engine core process {_describe_exit(code)} while loading the model"
                )

    def _watch_core(self) -> None:
        """Runs on a daemon thread: notices the core's exit; unless we stopped it, fails everything."""
        code = self._process.wait()
        if self._closing:
            return
        self.dead = f"the engine core process {_describe_exit(code)}"
        logger.error("%s; failing every request", self.dead)
        if self._on_dead is not None:
            self._on_dead(self.dead)
        loop = self._loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(self._fail_all)
            except RuntimeError:  # that loop is closed: nobody waits on it
                pass

    def _fail_all(self) -> None:
        self._on_readable()  # deliver what the core sent before it died
        reason = self.dead or "the engine core process is gone"
        for request_id, queue in self._streams.items():
            output = self._processor.abort(request_id, reason)
            queue.put_nowait(output or self._dead_output(request_id, 0))
        self._streams.clear()

    def _dead_output(self, request_id: str, num_prompt_tokens: int) -> RequestOutput:
        return RequestOutput(
            request_id=request_id,
            new_token_ids=[],
            new_text="",
            prompt_tokens=num_prompt_tokens,
            cached_tokens=0,
            completion_tokens=0,
            finish_reason="abort",
            error=self.dead,
        )

    def _stop_core(self, timeout_s: float) -> None:
        if self._process.poll() is not None:
            return
        if timeout_s > 0:
            self._send(ShutdownCore())
            try:
                self._process.wait(timeout_s)
                return
            except subprocess.TimeoutExpired:
                logger.warning("the engine core did not stop within %.0f s; killing it", timeout_s)
        self._process.kill()
        self._process.wait()

    def _close_sockets(self) -> None:
        self._to_core.close(linger=0)
        self._from_core.close(linger=0)
        self._zmq.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)


# Spin iterations of a waiting OpenMP thread before it sleeps (libgomp's default is 300,000, ~ms; PASSIVE is 0).
OPENMP_SPIN_COUNT = 30_000


def _core_environment() -> dict[str, str]:
    """The core's environment: ours, with OpenMP threads that spin briefly, then sleep, when they wait (unless
    `OMP_WAIT_POLICY` or `GOMP_SPINCOUNT` is set).

    The API process works while the core steps. OpenMP threads that spin without bound while they wait need
    every thread of the team on a core at each parallel region; once anything else wants a core (the API
    process, another program) a step can take many times as long. Measured on 2 cores (AsyncEngine alone, c1):
    ITL p50 / p90 ~6 / 8 ms spinning and ~11 / 13 ms passive on a quiet machine, but with one other busy
    process 17 / 99 ms spinning (steps of 260 ms) against 10 / 13 ms passive. Sleeping at once has its own
    cost: a prompt chunk runs ~10 parallel regions a layer back to back, and each wake-up is ~10-50 us. A
    bounded spin (`GOMP_SPINCOUNT`, libgomp's, torch's OpenMP on Linux) keeps the threads awake across those
    gaps and sleeps in the idle ones: served SmolLM2 on 2 Zen 5 cores with the API process and the load
    generator on the same cores (docs/benchmarks.md, session 10), against `OMP_WAIT_POLICY=PASSIVE`: GGUF c16
    output +17%, c1 TTFT p90 153-157 -> 109 ms; bf16 c16 +13%, c1 ITL p50 24.5 -> 16.4 ms.
    """
    env = dict(os.environ)
    if "OMP_WAIT_POLICY" not in env:
        env.setdefault("GOMP_SPINCOUNT", str(OPENMP_SPIN_COUNT))
    if memory_defaults_enabled(env):
        for name, value in CORE_MEMORY_ENVIRONMENT.items():
            env.setdefault(name, value)
    return env


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"
