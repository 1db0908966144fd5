"""A node other than node 0 of a multi-host deployment: it runs this host's ranks and nothing else
(node 0 runs the engine core and the API). `hearth serve --nnodes N --node-rank K ...` with K > 0
comes here, as does `python -m hearth.engine.ranks.node` with the same options.

It supervises its ranks like rank 0's executor does: one that fails stops the others and the node
exits with status 1; when node 0 stops them, every rank exits 0 and so does the node.
"""

from __future__ import annotations

import argparse
import logging
import signal
import subprocess
import sys
import time

from hearth.engine.config import EngineConfig
from hearth.engine.ranks.executor import WATCH_INTERVAL_S, spawn_rank, stop_processes
from hearth.parallel.topology import ParallelConfig

logger = logging.getLogger("hearth.distributed")


def run_node(config: EngineConfig) -> int:
    parallel = ParallelConfig.from_engine_config(config)
    if config.master_port is None:
        raise ValueError(
            "a node other than node 0 needs --master-port (and --master-addr): node 0's rendezvous"
        )
    children: dict[int, subprocess.Popen[bytes]] = {
        rank: spawn_rank(rank, parallel, config.device) for rank in parallel.local_ranks
    }
    stopped: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        stopped.append(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    logger.info(
        "node %d of %d: ranks %s, rendezvous at %s:%d",
        parallel.node_rank,
        parallel.nnodes,
        list(parallel.local_ranks),
        parallel.master_addr,
        parallel.master_port,
    )
    while not stopped:
        codes = {rank: process.poll() for rank, process in children.items()}
        failed = {rank: code for rank, code in codes.items() if code not in (None, 0)}
        if failed:
            rank, code = next(iter(failed.items()))
            logger.critical("rank %d exited with status %d; stopping this node's ranks", rank, code)
            for process in children.values():
                if process.poll() is None:
                    process.kill()
            stop_processes(children, 0)
            return 1
        if all(code == 0 for code in codes.values()):
            logger.info("node 0 stopped the ranks; exiting")
            return 0
        time.sleep(WATCH_INTERVAL_S)
    logger.info("stopped by signal %d; stopping this node's ranks", stopped[0])
    for process in children.values():
        process.kill()
    stop_processes(children, 0)
    return 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hearth.engine.ranks.node")
    EngineConfig.add_cli_arguments(parser, require_model=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s [node]: %(message)s")
    try:
        config = EngineConfig.from_cli_args(args)
    except ValueError as exc:
        print(f"hearth node: {exc}", file=sys.stderr)
        return 2
    return run_node(config)


if __name__ == "__main__":
    sys.exit(main())
