"""How each step's `StepInput` gets from the engine core (rank 0) to every other rank, and the sampling
rank's `StepOutput` back: ZeroMQ sockets (the default) or the gloo control group (`HEARTH_STEP_CHANNEL=gloo`,
the old path, kept for A/B measurement). Tensors between ranks stay on torch.distributed.

Why ZeroMQ: a step is a few hundred bytes to a few tens of kB of msgpack, and a gloo broadcast of it
(length, then bytes, as two collectives every rank must enter) measured 2.7-8 ms per step on a loaded
machine against ~0.1 ms for a PUB socket (docs/benchmarks.md). What gloo gave for free is handled here:
- The address: rank 0 binds on `master_addr` at a free port and tells the ranks in the `WorkerSpec`,
  which still goes over gloo once at startup (the rendezvous every rank already joined).
- The slow joiner (a PUB socket drops what it sends before a subscriber is connected): `sync` publishes
  "hello" until every rank has seen one and entered the control group's barrier.
- A dead rank 0: the subscriber watches its connection (a socket monitor) and raises when it drops,
  where a plain SUB socket would wait forever.
- A dead sampling rank: rank 0 waits for its output at most `COLLECTIVE_TIMEOUT_S`, as for a collective
  (its own node's ranks are watched by the executor anyway).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Protocol

import torch.distributed as dist
import zmq
import zmq.utils.monitor

from hearth.parallel.channel import broadcast_bytes, recv_bytes, send_bytes
from hearth.parallel.groups import COLLECTIVE_TIMEOUT_S, control_group
from hearth.parallel.state import COMM_BYTES

STEP, STOP, HELLO = b"s", b"x", b"h"
HELLO_INTERVAL_S = 0.01
POLL_SLICE_MS = 1000


def channel_kind() -> str:
    """`HEARTH_STEP_CHANNEL`: zmq (default) or gloo."""
    kind = os.environ.get("HEARTH_STEP_CHANNEL", "zmq")
    if kind not in ("zmq", "gloo"):
        raise ValueError(f"HEARTH_STEP_CHANNEL must be zmq or gloo, got {kind!r}")
    return kind


class CoreChannel(Protocol):
    """Rank 0's end. `endpoints` go to the ranks in the WorkerSpec; `sync` returns once every rank can
    receive (a collective: every rank calls its end's `sync`)."""

    endpoints: tuple[str, str]

    def sync(self) -> None: ...
    def publish(self, data: bytes) -> None: ...
    def stop(self) -> None: ...
    def receive_output(self, src: int) -> bytes: ...
    def close(self) -> None: ...


class RankChannel(Protocol):
    """Another rank's end: `receive` returns the next step's bytes, None when told to stop."""

    def sync(self) -> None: ...
    def receive(self) -> bytes | None: ...
    def send_output(self, data: bytes) -> None: ...
    def close(self) -> None: ...


# ---- gloo: the control group (the old path) ---------------------------------------------------------


class GlooCoreChannel:
    endpoints = ("", "")

    def sync(self) -> None:
        dist.barrier(group=control_group())

    def publish(self, data: bytes) -> None:
        broadcast_bytes(data)

    def stop(self) -> None:
        broadcast_bytes(None, stop=True)

    def receive_output(self, src: int) -> bytes:
        return recv_bytes(src)

    def close(self) -> None:
        pass


class GlooRankChannel:
    def sync(self) -> None:
        dist.barrier(group=control_group())

    def receive(self) -> bytes | None:
        return broadcast_bytes(None)

    def send_output(self, data: bytes) -> None:
        send_bytes(data, 0)

    def close(self) -> None:
        pass


# ---- ZeroMQ -----------------------------------------------------------------------------------------


class ZmqCoreChannel:
    """PUB for the steps, PULL for the sampling rank's outputs, both bound on `host`."""

    def __init__(self, host: str, world_size: int, local_only: bool) -> None:
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, 0)  # never drop a step (rank 0 is at most a step ahead anyway)
        self._pub.setsockopt(zmq.LINGER, 1000)
        self._pull = self._context.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        # One node: loopback only. Several: the interface of the rendezvous address `host` (which may be a
        # name: ZeroMQ binds addresses, so it is resolved), never every interface.
        bind = "tcp://127.0.0.1" if local_only else f"tcp://{socket.gethostbyname(host)}"
        step_port = self._pub.bind_to_random_port(bind)
        output_port = self._pull.bind_to_random_port(bind)
        self.endpoints = (f"tcp://{host}:{step_port}", f"tcp://{host}:{output_port}")
        self._others = world_size - 1

    def sync(self) -> None:
        done = threading.Event()

        def hello() -> None:  # the only user of the socket until `done`
            while not done.is_set():
                self._pub.send(HELLO)
                time.sleep(HELLO_INTERVAL_S)

        thread = threading.Thread(target=hello, name="hearth-step-hello", daemon=True)
        thread.start()
        try:
            dist.barrier(group=control_group())  # every rank has seen a hello: nothing sent from now is lost
        finally:
            done.set()
            thread.join()

    def publish(self, data: bytes) -> None:
        COMM_BYTES["step_broadcast"] += len(data) * self._others
        self._pub.send_multipart((STEP, data), copy=False)

    def stop(self) -> None:
        self._pub.send(STOP)

    def receive_output(self, src: int) -> bytes:
        deadline = time.monotonic() + COLLECTIVE_TIMEOUT_S
        while not self._pull.poll(POLL_SLICE_MS):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {src} sent no step output in {COLLECTIVE_TIMEOUT_S:.0f} s")
        return self._pull.recv()

    def close(self) -> None:
        self._context.destroy(linger=1000)


class RankZeroGone(ConnectionError):
    pass


class ZmqRankChannel:
    """SUB to rank 0's steps (with a monitor on the connection), PUSH of outputs when this rank samples."""

    def __init__(self, endpoints: tuple[str, str], sends_output: bool) -> None:
        self._context = zmq.Context()
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.RCVHWM, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        # Dropped connections are the dead-peer signal: no silent reconnects to a new rank 0.
        self._monitor = self._sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._sub.connect(endpoints[0])
        self._push = None
        if sends_output:
            self._push = self._context.socket(zmq.PUSH)
            self._push.setsockopt(zmq.LINGER, 1000)
            self._push.connect(endpoints[1])
        self._poller = zmq.Poller()
        self._poller.register(self._sub, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)

    def _next(self) -> list[bytes]:
        while True:
            ready = dict(self._poller.poll())
            if self._sub in ready:  # a stop that came before the disconnect is still read first
                return self._sub.recv_multipart()
            if self._monitor in ready:
                event = zmq.utils.monitor.recv_monitor_message(self._monitor)
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    raise RankZeroGone("rank 0's step socket closed (the engine core is gone)")

    def sync(self) -> None:
        while self._next()[0] != HELLO:
            pass
        dist.barrier(group=control_group())

    def receive(self) -> bytes | None:
        while True:
            frames = self._next()
            kind = frames[0]
            if kind == STEP:
                return frames[1]
            if kind == STOP:
                return None
            # HELLO: left over from `sync`

    def send_output(self, data: bytes) -> None:
        assert self._push is not None
        COMM_BYTES["step_output"] += len(data)
        self._push.send(data, copy=False)

    def close(self) -> None:
        self._sub.disable_monitor()
        self._context.destroy(linger=1000)


def core_channel(kind: str, host: str, world_size: int, local_only: bool) -> CoreChannel:
    return ZmqCoreChannel(host, world_size, local_only) if kind == "zmq" else GlooCoreChannel()


def rank_channel(kind: str, endpoints: tuple[str, str], sends_output: bool) -> RankChannel:
    return ZmqRankChannel(endpoints, sends_output) if kind == "zmq" else GlooRankChannel()
