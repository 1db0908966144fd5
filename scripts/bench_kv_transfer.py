"""KV transfer rate on loopback: `--kv-transfer tcp` between two processes vs a plain in-memory page copy.

    python scripts/bench_kv_transfer.py [--pages 128] [--repeats 5] [--dtype bfloat16]

The layout defaults to a Llama-3-8B-like one (32 layers, 8 KV heads x 128, 16-token pages: 2 MiB per
bf16 page; a 2k-token prompt is 128 pages). The sender runs in a child process with its own pool (as a
prefill server would), the receiver here; each repeat is one transfer of `--pages` pages (scattered
over the pools, as a real request's pages are), timed from `send` to the receiver's event.

Measured interleaved in every repeat (so a noisy machine hits all of them alike):
- `tcp`: the transport as shipped (socket buffers of `SOCKET_BUFFER_BYTES`);
- `tcp_default_buffers`: the same with the kernel's autotuned socket buffers (the A/B of that setting);
- `tcp_staged_send`: the same with the sender gathering each batch into a staging buffer before sending
  (the A/B of sending straight from the pool's pages with `sendmsg`);
- `tcp_buffered_receive`: the same with the receiver taking each batch into a buffer and copying it into
  the pool (the A/B of `recvmsg_into` straight into the pool's pages);
- `tcp_session4`: all three off, close to the transport before this work (it also allocated a fresh
  buffer per batch on both sides, which this does not reproduce);
- `memcpy`: one `Tensor.copy_` of the same number of bytes between two contiguous buffers (the ceiling);
- `pool_copy`: the same pages gathered from one pool and scattered into another in one process, by the
  code the transport uses on each side (`PoolPageSource.read_into` + `PoolSink`), with no wire at all.
Each transfer's CPU time (sender and receiver process together) is reported too: on a busy machine it
is steadier than the wall time, and it is what bounds the rate when the transfer is CPU-bound.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import secrets
import select
import statistics
import time

import torch

from hearth.kv.page_io import PageLayout
from hearth.kv.pool import KVLayout, KVPool
from hearth.kv_transfer import make_transport
from hearth.kv_transfer.base import ReceiveSpec, SendSpec
from hearth.kv_transfer.pool_pages import PoolPageSource, PoolSink
from hearth.kv_transfer.tcp import SOCKET_BUFFER_BYTES

SECRET = b"bench"
# name -> (socket buffer bytes, zero-copy send, direct receive)
VARIANTS = {
    "tcp": (SOCKET_BUFFER_BYTES, True, True),
    "tcp_default_buffers": (0, True, True),
    "tcp_staged_send": (SOCKET_BUFFER_BYTES, False, True),
    "tcp_buffered_receive": (SOCKET_BUFFER_BYTES, True, False),
    "tcp_session4": (0, False, False),  # both of the above and the kernel's buffers: as session 4 shipped
}


def layout_from(args: argparse.Namespace) -> KVLayout:
    return KVLayout(args.layers, args.kv_heads, args.head_dim, args.page_size, getattr(torch, args.dtype))


def scattered_pages(count: int, pool_pages: int, seed: int) -> list[int]:
    return random.Random(seed).sample(range(pool_pages), count)


def sender_main(args: argparse.Namespace, jobs: mp.Queue, done: mp.Queue) -> None:
    torch.set_num_threads(1)
    pool = KVPool(layout_from(args), args.pages * 2)
    pool.storage.normal_()
    transports = {}
    for name, (buffer_bytes, zero_copy, _) in VARIANTS.items():
        transport = make_transport("tcp", pool.io.layout, SECRET, 60.0, PoolSink(pool.io))
        transport.socket_buffer_bytes = buffer_bytes  # type: ignore[attr-defined]
        transport.zero_copy_send = zero_copy  # type: ignore[attr-defined]
        transports[name] = transport
    pages = scattered_pages(args.pages, args.pages * 2, 1)
    while (job := jobs.get()) is not None:
        name, transfer_id, endpoint = job
        transport = transports[name]
        transport.send(
            SendSpec(transfer_id, endpoint, PoolPageSource(pool.io, pages), args.pages * args.page_size, 0)
        )
        cpu_started = time.process_time()
        while not (events := transport.events()):
            select.select([transport.wakeup_fd], [], [], 1.0)
        done.put((events[0].ok, time.process_time() - cpu_started))
    for transport in transports.values():
        transport.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pages", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    torch.set_num_threads(1)
    layout = layout_from(args)
    receiver_pool = KVPool(layout, args.pages * 2)
    receiver_pool.storage.zero_()
    source_pool = KVPool(layout, args.pages * 2)
    source_pool.storage.normal_()
    receivers, endpoints = {}, {}
    for name, (buffer_bytes, _, direct) in VARIANTS.items():
        receiver = make_transport("tcp", PageLayout.of(layout), SECRET, 60.0, PoolSink(receiver_pool.io))
        receiver.socket_buffer_bytes = buffer_bytes  # type: ignore[attr-defined]
        receiver.direct_receive = direct  # type: ignore[attr-defined]
        receivers[name], endpoints[name] = receiver, receiver.listen("127.0.0.1", 0)
    context = mp.get_context("spawn")
    jobs, done = context.Queue(), context.Queue()
    child = context.Process(target=sender_main, args=(args, jobs, done))
    child.start()
    pages = scattered_pages(args.pages, args.pages * 2, 2)
    source = PoolPageSource(source_pool.io, scattered_pages(args.pages, args.pages * 2, 1))
    sink = PoolSink(receiver_pool.io)
    staging = torch.empty((args.pages, *PageLayout.of(layout).page_shape()), dtype=layout.kv_dtype)
    total_bytes = args.pages * layout.bytes_per_page
    flat_src = torch.empty(total_bytes, dtype=torch.uint8).random_()
    flat_dst = torch.empty_like(flat_src)
    times: dict[str, list[float]] = {name: [] for name in (*VARIANTS, "memcpy", "pool_copy")}
    cpu: dict[str, list[float]] = {name: [] for name in VARIANTS}  # sender + receiver CPU seconds
    for repeat in range(args.repeats + 1):  # the first round warms up (connections, page faults)
        for name, receiver in receivers.items():
            transfer_id = secrets.token_hex(16)  # as the router makes them
            receiver.open_receive(ReceiveSpec(transfer_id, 0, pages, args.pages * args.page_size - 1, 0))
            started, cpu_started = time.perf_counter(), time.process_time()
            jobs.put((name, transfer_id, endpoints[name]))
            while not (events := receiver.events()):
                select.select([receiver.wakeup_fd], [], [], 1.0)
            elapsed, receiver_cpu = time.perf_counter() - started, time.process_time() - cpu_started
            sent_ok, sender_cpu = done.get(timeout=60)
            assert events[0].ok and sent_ok, events
            if repeat:
                times[name].append(elapsed)
                cpu[name].append(receiver_cpu + sender_cpu)
        started = time.perf_counter()
        source.read_into(0, args.pages, staging)
        sink(pages, staging)
        copied = time.perf_counter() - started
        started = time.perf_counter()
        flat_dst.copy_(flat_src)
        memcopied = time.perf_counter() - started
        if repeat:
            times["pool_copy"].append(copied)
            times["memcpy"].append(memcopied)
    jobs.put(None)
    child.join(30)
    for receiver in receivers.values():
        receiver.close()
    median = {name: statistics.median(values) for name, values in times.items()}
    result: dict[str, object] = {
        "layout": PageLayout.of(layout).describe(),
        "pages": args.pages,
        "bytes": total_bytes,
        "repeats": args.repeats,
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }
    for name, seconds in median.items():
        result[f"{name}_median_s"] = round(seconds, 4)
        result[f"{name}_GBps"] = round(total_bytes / seconds / 1e9, 3)
        result[f"{name}_pages_per_s"] = round(args.pages / seconds, 1)
    result["tcp_vs_memcpy"] = round(median["memcpy"] / median["tcp"], 3)
    result["tcp_vs_pool_copy"] = round(median["pool_copy"] / median["tcp"], 3)
    for name in VARIANTS:
        result[f"{name}_cpu_s"] = round(statistics.median(cpu[name]), 4)
    for name in VARIANTS:
        if name != "tcp":
            result[f"tcp_vs_{name.removeprefix('tcp_')}"] = round(median[name] / median["tcp"], 3)
            # CPU seconds per transfer (both processes): what bounds the rate on a busy or a quiet machine
            result[f"cpu_{name.removeprefix('tcp_')}_over_tcp"] = round(
                statistics.median(cpu[name]) / statistics.median(cpu["tcp"]), 3
            )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
