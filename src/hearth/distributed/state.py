"""Where this process sits in tensor / pipeline / expert parallelism, and the collectives models call.

Models and layers ask this module, never torch.distributed directly, so the same model code runs on
one process (every collective is the identity) and on N ranks (`initialize` sets the groups up).

Contract:
- `parallel_state()` is the current `ParallelState`; one process alone is `ParallelState()`.
- `all_reduce_tp(x)` sums `x` over the tensor-parallel group (identity with one TP rank), in place
  when it can, and returns the result.
- `all_reduce_ep(x)` sums over the expert-parallel group (identity with one EP rank).
- `all_gather_tp(x, dim)` concatenates every TP rank's `x` along `dim` (identity with one TP rank).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ParallelState:
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1

    @property
    def layout_tag(self) -> str:
        """Part of the KV layout tag: pages computed under one layout never serve another."""
        return f"tp{self.tp_size}pp{self.pp_size}ep{self.ep_size}"


_STATE = ParallelState()
_TP_GROUP: object | None = None
_EP_GROUP: object | None = None


def parallel_state() -> ParallelState:
    return _STATE


def set_parallel_state(
    state: ParallelState, tp_group: object | None = None, ep_group: object | None = None
) -> None:
    """Install this process's place and groups (torch.distributed process groups); called once per rank."""
    global _STATE, _TP_GROUP, _EP_GROUP
    _STATE, _TP_GROUP, _EP_GROUP = state, tp_group, ep_group


def all_reduce_tp(x: torch.Tensor) -> torch.Tensor:
    if _STATE.tp_size == 1:
        return x
    torch.distributed.all_reduce(x, group=_TP_GROUP)
    return x


def all_reduce_ep(x: torch.Tensor) -> torch.Tensor:
    if _STATE.ep_size == 1:
        return x
    torch.distributed.all_reduce(x, group=_EP_GROUP)
    return x


def all_gather_tp(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    if _STATE.tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_STATE.tp_size)]
    torch.distributed.all_gather(parts, x.contiguous(), group=_TP_GROUP)
    return torch.cat(parts, dim=dim)
