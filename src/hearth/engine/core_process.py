"""The engine-core process of `hearth serve`: the `Engine` in a loop, fed and drained over ZeroMQ.

`AsyncEngine` (hearth.engine.async_engine) starts it as `python -m hearth.engine.core_process`; it is not
meant to be run by hand. The loop is busy while the engine has work: each pass takes every message that
arrived (adds, aborts) without waiting, runs one step, and sends the step's outputs, the answers to those
messages (rejected adds, aborted requests) and the engine's stats as one message. With no work it blocks on
the input socket.

It stops when the API process says so (`ShutdownCore`: what still runs is aborted first and the last
outputs are sent) or when the API process is gone (its pid is polled: an orphaned core would hold the
model's memory forever). SIGINT and SIGTERM are ignored: a Ctrl-C, or a service manager's SIGTERM, reaches
the whole process group, and the API process drains its in-flight requests before it stops the core.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING

import msgspec
import zmq

from hearth.engine.config import EngineConfig
from hearth.engine.messages import (
    AbortRequests,
    CoreFailed,
    CoreOutput,
    CoreOutputs,
    CoreReady,
    EngineRequest,
    ShutdownCore,
    ToCore,
)
from hearth.engine.sampling_params import InvalidParamError

if TYPE_CHECKING:
    from hearth.engine.engine import Engine

logger = logging.getLogger("hearth.engine")

# While busy, stats go out with every output message, and at least this often when steps produce none
# (a long prompt's prefill chunks).
STATS_INTERVAL_S = 0.5
PARENT_POLL_INTERVAL_S = 0.5
# A tier's loads finish on its loader thread without waking the loop: with tiers, the loop sleeps this
# long between polls of the loads instead of spinning (an arrival is noticed at most this late).
TIER_KV_WAIT_POLL_MS = 1
# Idle with KV connectors (tiers write back in the background): stats still go out this often, so
# /metrics sees writes that land after the last request.
IDLE_STATS_INTERVAL_MS = 1000
# How long the last messages (the outputs of a shutdown, a load failure) may take to reach the API process.
FINAL_SEND_LINGER_MS = 5000
# With only requests waiting for KV from elsewhere (or PD sends in flight), the loop sleeps on the input
# socket and the connectors' wakeup fds; this bounds the sleep so timeouts are noticed.
KV_WAIT_POLL_MS = 20


class EngineCoreLoop:
    """Drives one `Engine` from the input socket to the output socket until told to stop."""

    def __init__(self, engine: Engine, inbox: zmq.Socket, outbox: zmq.Socket) -> None:
        self.engine = engine
        self._inbox = inbox
        self._outbox = outbox
        self._decoder = msgspec.msgpack.Decoder(ToCore)
        self._encoder = msgspec.msgpack.Encoder()
        self._live: set[str] = set()  # ids added and not finished: what a failed step or a shutdown aborts
        self._answers: list[CoreOutput] = []  # rejected adds and aborted requests, sent with the next message
        self._shutdown: ShutdownCore | None = None
        self._last_sent_s = 0.0
        self._kv_poller = zmq.Poller()
        self._kv_poller.register(inbox, zmq.POLLIN)
        kv_loads = getattr(engine, "kv_loads", None)  # engines without KV connectors (test fakes) have none
        for fd in kv_loads.wakeup_fds if kv_loads is not None else []:
            self._kv_poller.register(fd, zmq.POLLIN)
        self._waits_for_kv = hasattr(engine, "has_runnable_work")
        has_tiers = kv_loads is not None and "tier" in kv_loads.connectors
        self._kv_wait_ms = TIER_KV_WAIT_POLL_MS if has_tiers else KV_WAIT_POLL_MS

    def run(self) -> None:
        engine = self.engine
        inbox = self._inbox
        while self._shutdown is None:
            if not engine.has_work:
                # idle: sleep until a message comes (or, with connectors at work, until stats are due)
                inbox.poll(IDLE_STATS_INTERVAL_MS if engine.has_kv_connectors else None)
            elif self._waits_for_kv and (not engine.has_runnable_work or engine.only_waiting_for_kv):
                self._kv_poller.poll(self._kv_wait_ms)  # only KV in flight: no busy spin
            if inbox.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                self._drain()
                if self._shutdown is not None:
                    break
            outputs = self._step() if engine.has_work else []
            if self._answers:
                outputs = self._answers + outputs
                self._answers = []
            if outputs or time.monotonic() - self._last_sent_s >= STATS_INTERVAL_S:
                self._send(outputs)
        self._answers.extend(self.engine.abort(list(self._live), self._shutdown.reason))
        self._send(self._answers)

    def _drain(self) -> None:
        recv, decode = self._inbox.recv, self._decoder.decode
        while True:
            try:
                message = decode(recv(zmq.NOBLOCK))
            except zmq.Again:
                return
            if isinstance(message, EngineRequest):
                self._add(message)
            elif isinstance(message, AbortRequests):
                self._answers.extend(self.engine.abort(message.request_ids, message.reason))
                self._live.difference_update(message.request_ids)
            else:
                self._shutdown = message
                return

    def _add(self, request: EngineRequest) -> None:
        try:
            self.engine.add_request(request)
        except InvalidParamError as exc:
            self._answers.append(_rejected(request, str(exc), exc.param))
        except Exception as exc:  # e.g. a request id already in use: fail the request, keep serving
            logger.warning("request %s not added: %s", request.request_id, exc)
            self._answers.append(_rejected(request, str(exc), None))
        else:
            self._live.add(request.request_id)

    def _step(self) -> list[CoreOutput]:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            logger.exception("engine step failed; failing the requests it was running")
            outputs = self.engine.abort(list(self._live), f"engine error: {exc}")
            for output in outputs:
                output.finish_reason = "error"
        live = self._live
        for output in outputs:
            if output.finish_reason is not None:
                live.discard(output.request_id)
        return outputs

    def _send(self, outputs: list[CoreOutput]) -> None:
        self._outbox.send(self._encoder.encode(CoreOutputs(outputs, self.engine.stats())))
        self._last_sent_s = time.monotonic()


def _rejected(request: EngineRequest, message: str, param: str | None) -> CoreOutput:
    return CoreOutput(
        request_id=request.request_id,
        new_token_ids=[],
        num_prompt_tokens=len(request.prompt_token_ids),
        num_cached_tokens=0,
        finish_reason="error",
        error=message,
        rejected_param=param,
    )


def _exit_with_parent(parent_pid: int, ipc_dir: str | None) -> None:
    """Runs on a daemon thread: once the API process is gone, nobody reads the outputs; exit at once,
    whatever the main thread is doing (loading, stepping), and remove the sockets the parent left."""
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_INTERVAL_S)
    logger.warning("the API process (pid %d) is gone; the engine core exits", parent_pid)
    if ipc_dir:
        shutil.rmtree(ipc_dir, ignore_errors=True)
    os._exit(1)


def _ipc_dir(address: str) -> str | None:
    return os.path.dirname(address.removeprefix("ipc://")) if address.startswith("ipc://") else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hearth.engine.core_process")
    # Internal flags, named apart from the user-facing `--config FILE` and `--log-level NAME`.
    parser.add_argument("--engine-config-json", required=True, help="EngineConfig as JSON")
    parser.add_argument("--input", required=True, help="ZeroMQ address the API process sends to")
    parser.add_argument("--output", required=True, help="ZeroMQ address the API process reads from")
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--log-level-number", type=int, default=logging.INFO)
    args = parser.parse_args(argv)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(
        level=args.log_level_number, format="%(asctime)s %(levelname)s %(name)s [engine core]: %(message)s"
    )
    threading.Thread(
        target=_exit_with_parent,
        args=(args.parent_pid, _ipc_dir(args.input)),
        name="hearth-parent-watch",
        daemon=True,
    ).start()

    context = zmq.Context(io_threads=1)
    outbox = context.socket(zmq.PUSH)
    outbox.setsockopt(zmq.SNDHWM, 0)  # never block or drop an output; the API process reads them all
    outbox.connect(args.output)
    inbox = context.socket(zmq.PULL)
    inbox.setsockopt(zmq.RCVHWM, 0)
    inbox.connect(args.input)
    encoder = msgspec.msgpack.Encoder()
    try:
        config = msgspec.json.decode(args.engine_config_json, type=EngineConfig)
        from hearth.engine.factory import build_engine

        engine = build_engine(config)
    except Exception as exc:
        from hearth.model.config import ModelLoadError

        if not isinstance(exc, ModelLoadError):  # a bug rather than a bad checkpoint: keep the traceback
            logger.exception("the engine core could not start")
        outbox.send(encoder.encode(CoreFailed(str(exc) or type(exc).__name__)))
        outbox.close(linger=FINAL_SEND_LINGER_MS)
        return 1
    outbox.send(
        encoder.encode(
            CoreReady(
                max_model_len=engine.max_model_len,
                num_kv_tokens=engine.num_kv_tokens,
                vocab_size=engine.vocab_size,
                stats=engine.stats(),
                kv_transfer_endpoint=engine.kv_transfer_endpoint,
            )
        )
    )
    EngineCoreLoop(engine, inbox, outbox).run()
    engine.close()
    inbox.close(linger=0)
    outbox.close(linger=FINAL_SEND_LINGER_MS)
    context.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
