"""One rank other than rank 0: `python -m hearth.engine.ranks.rank_process`, started by rank 0's
executor (or, on another host, by `hearth.engine.ranks.node`). Not meant to be run by hand.

It joins the deployment, builds its worker from the spec rank 0 broadcasts, then runs every step rank
0 broadcasts until told to stop. Any error exits with status 1 (its supervisor stops the rest), and it
exits when its parent process is gone: a rank nobody steps would hold its memory forever.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time

import msgspec

from hearth.contracts.step import StepInput
from hearth.engine.ranks.executor import WorkerSpec, build_worker
from hearth.engine.ranks.step_channel import rank_channel
from hearth.engine.worker import resolve_device
from hearth.parallel.channel import broadcast_bytes
from hearth.parallel.groups import init_rank
from hearth.parallel.groups import shutdown as leave_group
from hearth.parallel.state import PIPELINE_TIME_S
from hearth.parallel.topology import ParallelConfig

logger = logging.getLogger("hearth.distributed")
PARENT_POLL_INTERVAL_S = 0.5


def _exit_with_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_INTERVAL_S)
    logger.warning("the process that started this rank (pid %d) is gone; exiting", parent_pid)
    os._exit(1)


def serve(rank: int) -> None:
    """Steps until rank 0 says stop; the sampling rank sends its outputs to rank 0."""
    spec = msgspec.msgpack.decode(broadcast_bytes(None) or b"", type=WorkerSpec)
    parallel_config = ParallelConfig.from_engine_config(spec.config)
    sends_output = parallel_config.state_of(rank).is_sampling_rank and rank != 0
    channel = rank_channel(spec.step_channel, spec.step_endpoints, sends_output)
    worker = build_worker(spec, parallel_config, rank)
    channel.sync()  # with rank 0: every rank has its shard and receives steps
    decoder = msgspec.msgpack.Decoder(StepInput)
    encoder = msgspec.msgpack.Encoder()
    while True:
        start = time.perf_counter()
        data = channel.receive()
        PIPELINE_TIME_S["step_wait_s"] += time.perf_counter() - start  # idle, and the step's transport
        if data is None:
            break
        output = worker.execute(decoder.decode(data))
        if sends_output:
            channel.send_output(encoder.encode(output))
    if worker.kv_worker is not None:
        worker.kv_worker.close()  # queued tier writes get a moment to finish
    log_rank_report(rank, worker)
    channel.close()


def log_rank_report(rank: int, worker: object) -> None:
    """What this rank held and sent (scripts/measure_parallel.py reads the line)."""
    import json
    import resource

    from hearth.parallel.state import COMM_BYTES

    model = worker.model  # type: ignore[attr-defined]
    report = {
        "rank": rank,
        "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "comm_bytes": dict(COMM_BYTES),
        "pipeline_time_s": dict(PIPELINE_TIME_S),
    }
    logger.info("rank report %s", json.dumps(report))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hearth.engine.ranks.rank_process")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--parallel", required=True, help="ParallelConfig as JSON")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--log-level-number", type=int, default=logging.INFO)  # not --log-level NAME
    args = parser.parse_args(argv)
    for sig in (signal.SIGINT, signal.SIGTERM):  # the supervisor decides when this rank stops
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(
        level=args.log_level_number,
        format=f"%(asctime)s %(levelname)s %(name)s [rank {args.rank}]: %(message)s",
    )
    threading.Thread(target=_exit_with_parent, args=(args.parent_pid,), daemon=True).start()
    parallel = msgspec.json.decode(args.parallel, type=ParallelConfig)
    try:
        init_rank(parallel, args.rank, resolve_device(args.device))
        serve(args.rank)
    except Exception:
        logger.exception("rank %d failed", args.rank)
        logging.shutdown()
        os._exit(1)
    leave_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
