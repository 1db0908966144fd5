"""Where this process sits in tensor / pipeline / expert parallelism, and the collectives models call.

Models and layers ask this module, never torch.distributed directly, so the same model code runs on
one process (every collective is the identity) and on N ranks (`hearth.parallel.groups` sets the
groups up and calls `set_parallel_state`).

Contract:
- `parallel_state()` is the current `ParallelState`; one process alone is `ParallelState()`.
- `all_reduce_tp(x)` sums `x` over the tensor-parallel group (identity with one TP rank), in place
  when it can, and returns the result.
- `all_reduce_ep(x)` sums over the expert-parallel group (identity with one EP rank).
- `all_gather_tp(x, dim)` concatenates every TP rank's `x` along `dim` (identity with one TP rank).
- `send_to_next_stage(x)` / `recv_from_previous_stage(shape, dtype, device)` move the activations
  between pipeline stages (same TP rank, next / previous stage). The send is asynchronous (a stage goes
  on with its next micro-batch); `wait_for_sends()` waits for every send still in flight. Sends and
  receives between a pair of ranks are matched in order.
- `COMM_BYTES` counts the payload bytes this rank sent through each kind of collective (benchmarks
  read it to compare TP and PP traffic per token).
- `PIPELINE_TIME_S` adds up, per rank, the seconds a pipeline stage spent blocked receiving its input
  (`recv_wait_s`: the stage idles) and waiting for its sends (`send_wait_s`), and in the forward in all
  (`forward_s`, from `hearth.engine.ranks.microbatch`).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
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

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_sampling_rank(self) -> bool:
        """Sampling happens once: on the last pipeline stage's first tensor-parallel rank."""
        return self.is_last_stage and self.tp_rank == 0

    def global_rank(self, pp_rank: int, tp_rank: int) -> int:
        """Ranks are laid out TP-innermost: a TP group is consecutive ranks (one node, fast links)."""
        return pp_rank * self.tp_size + tp_rank


_STATE = ParallelState()
_TP_GROUP: object | None = None
_EP_GROUP: object | None = None
# Payload bytes this rank put on the wire, per kind: "tp_all_reduce", "tp_all_gather", "ep_all_reduce",
# "pp_send", "step_broadcast", "step_output".
COMM_BYTES: Counter[str] = Counter()
PIPELINE_TIME_S: Counter[str] = Counter()
_PENDING_SENDS: list[tuple[object, torch.Tensor]] = []  # (work, the buffer it reads) until waited for


def parallel_state() -> ParallelState:
    return _STATE


@contextmanager
def single_rank() -> Iterator[None]:
    """Within: this process acts as a deployment of one rank (no collectives), for a model that lives whole
    on this rank beside its shard of the target (a proposer's draft model or head on rank 0)."""
    global _STATE, _TP_GROUP, _EP_GROUP
    saved = _STATE, _TP_GROUP, _EP_GROUP
    _STATE, _TP_GROUP, _EP_GROUP = ParallelState(), None, None
    try:
        yield
    finally:
        _STATE, _TP_GROUP, _EP_GROUP = saved


def set_parallel_state(
    state: ParallelState, tp_group: object | None = None, ep_group: object | None = None
) -> None:
    """Install this process's place and groups (torch.distributed process groups); called once per rank."""
    global _STATE, _TP_GROUP, _EP_GROUP
    _STATE, _TP_GROUP, _EP_GROUP = state, tp_group, ep_group


def _ring_bytes(x: torch.Tensor, size: int) -> int:
    # A ring all-reduce sends 2 (n - 1) / n of the tensor per rank; an all-gather (n - 1) chunks.
    return 2 * (size - 1) * x.numel() * x.element_size() // size


def all_reduce_tp(x: torch.Tensor) -> torch.Tensor:
    if _STATE.tp_size == 1:
        return x
    COMM_BYTES["tp_all_reduce"] += _ring_bytes(x, _STATE.tp_size)
    torch.distributed.all_reduce(x, group=_TP_GROUP)
    return x


def all_reduce_ep(x: torch.Tensor) -> torch.Tensor:
    if _STATE.ep_size == 1:
        return x
    COMM_BYTES["ep_all_reduce"] += _ring_bytes(x, _STATE.ep_size)
    torch.distributed.all_reduce(x, group=_EP_GROUP)
    return x


def all_gather_tp(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    if _STATE.tp_size == 1:
        return x
    COMM_BYTES["tp_all_gather"] += (_STATE.tp_size - 1) * x.numel() * x.element_size()
    parts = [torch.empty_like(x) for _ in range(_STATE.tp_size)]
    torch.distributed.all_gather(parts, x.contiguous(), group=_TP_GROUP)
    return torch.cat(parts, dim=dim)


def send_to_next_stage(x: torch.Tensor) -> None:
    state = _STATE
    COMM_BYTES["pp_send"] += x.numel() * x.element_size()
    x = x.contiguous()
    work = torch.distributed.isend(x, state.global_rank(state.pp_rank + 1, state.tp_rank))
    _PENDING_SENDS.append((work, x))


def wait_for_sends() -> None:
    start = time.perf_counter()
    while _PENDING_SENDS:
        work, _ = _PENDING_SENDS.pop(0)
        work.wait()  # type: ignore[attr-defined]
    PIPELINE_TIME_S["send_wait_s"] += time.perf_counter() - start


def recv_from_previous_stage(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    state = _STATE
    x = torch.empty(shape, dtype=dtype, device=device)
    start = time.perf_counter()
    torch.distributed.recv(x, state.global_rank(state.pp_rank - 1, state.tp_rank))
    PIPELINE_TIME_S["recv_wait_s"] += time.perf_counter() - start
    return x
