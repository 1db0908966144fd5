"""The engine core's line to the other ranks, over the CPU (gloo) control group: each step's
`StepInput` broadcast from rank 0 as msgpack bytes, and the sampling rank's `StepOutput` sent back
when that rank is not rank 0 (pipeline parallelism: the last stage samples).

Why torch.distributed and not a ZeroMQ PUB socket: the ranks already hold gloo connections to each
other (no second transport, address or port to configure across nodes), a dead peer is reported at
once ("connection closed by peer") instead of a subscriber waiting forever, and there is no
slow-joiner window in which a PUB socket drops the first steps. The cost is two small broadcasts per
step (the length, then the bytes); docs/benchmarks.md has the measured time.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hearth.parallel.groups import control_group
from hearth.parallel.state import COMM_BYTES

STOP = -1  # a length that says "no more steps: exit"


def broadcast_bytes(data: bytes | None, stop: bool = False) -> bytes | None:
    """On rank 0: send `data` (or, with `stop`, the stop signal) to every rank; elsewhere: wait for it
    and return it (None for the stop signal)."""
    group = control_group()
    length = torch.tensor([STOP if stop else len(data or b"")], dtype=torch.int64)
    dist.broadcast(length, 0, group=group)
    size = int(length.item())
    if size == STOP:
        return None
    if data is not None:
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        COMM_BYTES["step_broadcast"] += size * (dist.get_world_size() - 1)
    else:
        buffer = torch.empty(size, dtype=torch.uint8)
    if size:
        dist.broadcast(buffer, 0, group=group)
    return buffer.numpy().tobytes()


def send_bytes(data: bytes, dst: int) -> None:
    group = control_group()
    COMM_BYTES["step_output"] += len(data)
    dist.send(torch.tensor([len(data)], dtype=torch.int64), dst, group=group)
    dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst, group=group)


def recv_bytes(src: int) -> bytes:
    group = control_group()
    length = torch.empty(1, dtype=torch.int64)
    dist.recv(length, src, group=group)
    buffer = torch.empty(int(length.item()), dtype=torch.uint8)
    dist.recv(buffer, src, group=group)
    return buffer.numpy().tobytes()


def gather_bytes(data: bytes) -> list[bytes] | None:
    """Every rank's `data` to rank 0 over the control group (a collective: every rank calls it); rank 0
    gets them in rank order, the others None."""
    group = control_group()
    world = dist.get_world_size()
    rank = dist.get_rank()
    length = torch.tensor([len(data)], dtype=torch.int64)
    lengths = [torch.empty(1, dtype=torch.int64) for _ in range(world)] if rank == 0 else None
    dist.gather(length, lengths, dst=0, group=group)
    size = max(int(t.item()) for t in lengths) if lengths is not None else 0
    size_t = torch.tensor([size], dtype=torch.int64)
    dist.broadcast(size_t, 0, group=group)  # every rank pads to the longest
    size = int(size_t.item())
    buffer = torch.zeros(size, dtype=torch.uint8)
    if data:
        buffer[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    parts = [torch.empty(size, dtype=torch.uint8) for _ in range(world)] if rank == 0 else None
    dist.gather(buffer, parts, dst=0, group=group)
    if rank != 0:
        COMM_BYTES["kv_events"] += len(data)
        return None
    assert parts is not None and lengths is not None
    return [part[: int(n.item())].numpy().tobytes() for part, n in zip(parts, lengths, strict=True)]
