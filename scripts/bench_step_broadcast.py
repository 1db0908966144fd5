"""How long getting a step's bytes to the other ranks takes: gloo broadcast (what hearth.parallel.channel
does: length, then bytes) against a ZeroMQ PUB/SUB socket over TCP loopback, rank 0 -> 1 other rank,
round trip (the receiver answers with one byte on the same transport, so both ends are timed).

    PYTHONPATH=src python scripts/bench_step_broadcast.py
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import statistics
import time

SIZES = (512, 20_000)  # a batch-1 decode step; a batch-64 step (~310 B per token)
ROUNDS = 300


def gloo(rank: int, port: int, out: mp.Queue) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=60),
    )
    for size in SIZES:
        times = []
        for _ in range(ROUNDS):
            start = time.perf_counter()
            length = torch.tensor([size], dtype=torch.int64)
            dist.broadcast(length, 0)
            buffer = torch.empty(int(length.item()), dtype=torch.uint8)
            dist.broadcast(buffer, 0)
            ack = torch.zeros(1)
            dist.broadcast(ack, 1)
            times.append(time.perf_counter() - start)
        if rank == 0:
            out.put(("gloo", size, statistics.median(times)))
    dist.destroy_process_group()


def zmq_pubsub(rank: int, port: int, out: mp.Queue) -> None:
    import zmq

    context = zmq.Context()
    if rank == 0:
        pub, ack = context.socket(zmq.PUB), context.socket(zmq.PULL)
        pub.bind(f"tcp://127.0.0.1:{port}")
        ack.bind(f"tcp://127.0.0.1:{port + 1}")
        while not pub.poll(10, zmq.POLLOUT) or not ack.poll(0):  # wait out the slow-joiner window
            pub.send(b"hello")
        while ack.poll(100):
            ack.recv()
        for size in SIZES:
            payload, times = b"x" * size, []
            for _ in range(ROUNDS):
                start = time.perf_counter()
                pub.send(payload)
                ack.recv()
                times.append(time.perf_counter() - start)
            out.put(("zmq", size, statistics.median(times)))
        pub.send(b"")
    else:
        sub, ack = context.socket(zmq.SUB), context.socket(zmq.PUSH)
        sub.connect(f"tcp://127.0.0.1:{port}")
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        ack.connect(f"tcp://127.0.0.1:{port + 1}")
        while True:
            message = sub.recv()
            if not message:
                break
            ack.send(b"a")
    context.destroy(linger=0)


def main() -> None:
    import socket

    out: mp.Queue = mp.Queue()
    for target in (gloo, zmq_pubsub):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = [mp.Process(target=target, args=(rank, port, out)) for rank in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
    while not out.empty():
        kind, size, median_s = out.get()
        print(f"{kind:5s} {size:6d} B  median round trip {median_s * 1e6:7.1f} us")


if __name__ == "__main__":
    main()
