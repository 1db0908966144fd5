"""Joining the ranks of one deployment: torch.distributed's TCP rendezvous at `master_addr:master_port`
(as torchrun's), the tensor-parallel groups (the expert-parallel group is the same ranks), and a CPU
control group the engine core uses to send each step to every rank.

Three timeouts, on purpose: the rendezvous waits `RENDEZVOUS_TIMEOUT_S` (10 min, a loaded host starts
processes slowly) for every rank to join; collectives inside a step (all-reduce, pipeline sends) fail after
`COLLECTIVE_TIMEOUT_S` (a rank that stops answering must not hang the others), but a rank waiting for
the next step may wait as long as the server is idle, so the control group's timeout is a day; a rank
that dies is noticed at once anyway (gloo reports "connection closed by peer").
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from hearth.parallel.state import ParallelState, set_parallel_state
from hearth.parallel.topology import ParallelConfig

logger = logging.getLogger("hearth.distributed")

COLLECTIVE_TIMEOUT_S = float(os.environ.get("HEARTH_COLLECTIVE_TIMEOUT_S", "120"))
CONTROL_TIMEOUT_S = 24 * 3600.0
RENDEZVOUS_TIMEOUT_S = float(os.environ.get("HEARTH_RENDEZVOUS_TIMEOUT_S", "600"))

_CONTROL_GROUP: object | None = None


def init_rank(config: ParallelConfig, rank: int, device: torch.device) -> ParallelState:
    """Joins the deployment as `rank` (blocks until all ranks have joined) and installs its ParallelState."""
    global _CONTROL_GROUP
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(rank % max(1, torch.cuda.device_count()))
    # The rendezvous waits longer than a collective: on a loaded host a rank's process can take minutes to
    # import torch and get here (seen: 1 of 4 ranks joined after 120 s at load average 21).
    store = dist.TCPStore(
        config.master_addr,
        config.master_port,
        config.world_size,
        is_master=rank == 0,
        timeout=timedelta(seconds=RENDEZVOUS_TIMEOUT_S),
        wait_for_workers=True,
    )
    dist.init_process_group(
        backend=backend,
        store=store,
        world_size=config.world_size,
        rank=rank,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    state = config.state_of(rank)
    tp_group = None
    for pp_rank in range(config.pp_size):  # every rank creates every group, in the same order
        ranks = [state.global_rank(pp_rank, t) for t in range(config.tp_size)]
        group = dist.new_group(ranks, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        if pp_rank == state.pp_rank:
            tp_group = group
    _CONTROL_GROUP = dist.new_group(
        list(range(config.world_size)), backend="gloo", timeout=timedelta(seconds=CONTROL_TIMEOUT_S)
    )
    set_parallel_state(state, tp_group=tp_group, ep_group=tp_group if config.expert_parallel else None)
    logger.info("rank %d of %d joined (%s, %s)", rank, config.world_size, backend, state)
    return state


def control_group() -> object:
    if _CONTROL_GROUP is None:
        raise RuntimeError("init_rank() has not run in this process")
    return _CONTROL_GROUP


def shutdown() -> None:
    global _CONTROL_GROUP
    if dist.is_initialized():
        dist.destroy_process_group()
    _CONTROL_GROUP = None
    set_parallel_state(ParallelState())
