"""Rank 0's side of a parallel deployment, in the engine-core process: it starts and supervises this
node's other ranks, joins them, and stands in for the `Worker` the engine steps (`execute(step)`).

Each step: the `StepInput` is broadcast to every rank (`hearth.parallel.channel`), rank 0 runs its
own shard, and when rank 0 is not the sampling rank (pipeline parallelism: the last stage samples) the
sampled tokens come back from that rank.

Failure is fatal by design: after one rank is gone the others' state (KV pages, collectives half done)
cannot be trusted, so rank 0 logs which rank failed and how, stops every rank of its node, and exits
the process with status 1. Under `hearth serve` the API process sees the engine core die and exits
non-zero. Nothing waits forever: a rank that exits is seen by the watcher within
`WATCH_INTERVAL_S`, and a collective with a rank that stopped answering fails after
`COLLECTIVE_TIMEOUT_S`.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import msgspec
import torch

from hearth.contracts.step import StepInput, StepOutput
from hearth.engine.config import EngineConfig
from hearth.engine.ranks.step_channel import CoreChannel, channel_kind, core_channel
from hearth.engine.worker import Worker, kv_layout_for, resolve_device
from hearth.model.config import ModelConfig
from hearth.parallel.channel import broadcast_bytes
from hearth.parallel.groups import init_rank
from hearth.parallel.groups import shutdown as leave_group
from hearth.parallel.state import PIPELINE_TIME_S
from hearth.parallel.topology import ParallelConfig

logger = logging.getLogger("hearth.distributed")

WATCH_INTERVAL_S = 0.2
STOP_WAIT_S = 10.0


class WorkerSpec(msgspec.Struct):
    """What every rank needs to build the same worker as rank 0 (rank 0 decides, from its options)."""

    config: EngineConfig
    dtype: str
    num_pages: int
    max_model_len: int
    sample_vocab_size: int
    eos_token_ids: list[int]
    # How steps reach the ranks (hearth.engine.ranks.step_channel): "zmq" with rank 0's two endpoints, or "gloo".
    step_channel: str = "gloo"
    step_endpoints: tuple[str, str] = ("", "")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rank_threads(config: EngineConfig, parallel: ParallelConfig) -> int:
    """CPU threads per rank: `--num-threads`, else this node's cores shared among its ranks."""
    return config.num_threads or max(1, len(os.sched_getaffinity(0)) // parallel.ranks_per_node)


def build_worker(spec: WorkerSpec, parallel: ParallelConfig, rank: int) -> Worker:
    config = dataclasses.replace(
        spec.config,
        num_threads=rank_threads(spec.config, parallel),
        load_progress=spec.config.load_progress and rank == 0,  # one progress bar, not one per rank
    )
    model_config = ModelConfig.from_dir(config.model)
    dtype = getattr(torch, spec.dtype)
    layout = kv_layout_for(config, model_config, dtype)
    return Worker(
        config,
        model_config,
        dtype,
        layout,
        spec.num_pages,
        spec.max_model_len,
        spec.sample_vocab_size,
        spec.eos_token_ids,
    )


def spawn_rank(rank: int, parallel: ParallelConfig, device: str) -> subprocess.Popen[bytes]:
    """Starts global rank `rank` on this host as a child process (it exits when this process is gone)."""
    command = [
        sys.executable,
        "-m",
        "hearth.engine.ranks.rank_process",
        "--rank",
        str(rank),
        "--parallel",
        msgspec.json.encode(parallel).decode(),
        "--device",
        device,
        "--parent-pid",
        str(os.getpid()),
        "--log-level-number",
        str(logging.getLogger().getEffectiveLevel()),
    ]
    process = subprocess.Popen(command)
    logger.info("rank %d started (pid %d)", rank, process.pid)
    return process


def stop_processes(children: dict[int, subprocess.Popen[bytes]], wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    for process in children.values():
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def check_devices_for_ranks(num_local_ranks: int, device: torch.device) -> None:
    """One GPU per rank: NCCL refuses two ranks on one device, deep inside the first collective."""
    if device.type == "cuda" and num_local_ranks > torch.cuda.device_count():
        raise ValueError(
            f"{num_local_ranks} ranks on this node need {num_local_ranks} GPUs, found "
            f"{torch.cuda.device_count()}: lower --tensor-parallel-size/--pipeline-parallel-size, spread the "
            "ranks over nodes (--nnodes), or run on the CPU (--device cpu)"
        )


class DistributedExecutor:
    """`execute(step) -> StepOutput` over every rank; the engine's `worker`. Other attributes (`model`,
    `dtype`, `device`, `kv_pool`) are rank 0's worker's."""

    def __init__(self, config: EngineConfig, spec: WorkerSpec) -> None:
        self.parallel = parallel = ParallelConfig.from_engine_config(config)
        check_devices_for_ranks(len(parallel.local_ranks), resolve_device(config.device))
        self._stopping = False
        self._fatal_lock = threading.Lock()
        self._children: dict[int, subprocess.Popen[bytes]] = {
            rank: spawn_rank(rank, parallel, config.device) for rank in parallel.local_ranks[1:]
        }
        threading.Thread(target=self._watch, name="hearth-rank-watch", daemon=True).start()
        self.state = init_rank(parallel, 0, resolve_device(config.device))
        self._sampling_rank = self.state.global_rank(parallel.pp_size - 1, 0)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(StepOutput)
        try:
            kind = channel_kind()
            self.channel: CoreChannel = core_channel(
                kind, parallel.master_addr, parallel.world_size, local_only=parallel.nnodes == 1
            )
            spec = msgspec.structs.replace(spec, step_channel=kind, step_endpoints=self.channel.endpoints)
            broadcast_bytes(self._encoder.encode(spec))  # the one message that goes over gloo
            self.worker = build_worker(spec, parallel, 0)
            self.channel.sync()  # every rank has its shard and receives steps
        except Exception as exc:
            self._fatal(f"the ranks could not start: {exc}")
        atexit.register(self.shutdown)
        logger.info(
            "%d ranks ready (tensor parallel %d x pipeline parallel %d%s, %d node(s))",
            parallel.world_size,
            parallel.tp_size,
            parallel.pp_size,
            ", expert parallel" if parallel.expert_parallel else "",
            parallel.nnodes,
        )

    def __getattr__(self, name: str) -> Any:
        if name == "worker":  # not built yet
            raise AttributeError(name)
        return getattr(self.worker, name)

    @property
    def child_pids(self) -> dict[int, int]:
        return {rank: process.pid for rank, process in self._children.items()}

    def execute(self, step: StepInput) -> StepOutput:
        try:
            start = time.perf_counter()
            self.channel.publish(self._encoder.encode(step))
            published = time.perf_counter()
            output = self.worker.execute(step)
            if self._sampling_rank != 0:
                executed = time.perf_counter()
                kv_events = output.kv_events  # every rank's, gathered by rank 0's worker
                output = self._decoder.decode(self.channel.receive_output(self._sampling_rank))
                output.kv_events = kv_events
                PIPELINE_TIME_S["output_wait_s"] += time.perf_counter() - executed
            PIPELINE_TIME_S["step_publish_s"] += published - start
            PIPELINE_TIME_S["step_s"] += time.perf_counter() - start
            return output
        except Exception as exc:
            self._fatal(f"a step failed across the ranks: {exc}")

    def _exited_child(self, wait_s: float) -> str | None:
        """Which child rank has exited, if one has within `wait_s`: the cause a failed collective reports."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank, process in self._children.items():
                code = process.poll()
                if code is not None:
                    return f"rank {rank} (pid {process.pid}) exited with status {code}"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def shutdown(self) -> None:
        """Tells every rank to exit and waits for this node's; idempotent."""
        if self._stopping:
            return
        self._stopping = True
        try:
            self.channel.stop()
        except Exception:  # a rank already gone: stop the rest below
            pass
        stop_processes(self._children, STOP_WAIT_S)
        self.channel.close()
        leave_group()

    def _watch(self) -> None:
        while not self._stopping:
            for rank, process in self._children.items():
                code = process.poll()
                if code is not None and not self._stopping:
                    self._fatal(f"rank {rank} (pid {process.pid}) exited with status {code}")
            time.sleep(WATCH_INTERVAL_S)

    def _fatal(self, reason: str) -> Any:
        with self._fatal_lock:  # the watcher and a failed step may both get here; one reports
            self._stopping = True
            if not reason.startswith("rank "):
                # A collective fails as soon as a peer's connection drops; name the rank that died.
                cause = self._exited_child(WATCH_INTERVAL_S * 5)
                if cause is not None:
                    reason = f"{cause} ({reason})"
            logger.critical("%s; stopping every rank and exiting", reason)
            for process in self._children.values():
                if process.poll() is None:
                    process.send_signal(signal.SIGKILL)
            logging.shutdown()
            os._exit(1)
