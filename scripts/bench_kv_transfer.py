"""KV transfer rate on loopback: `--kv-transfer tcp` between two processes vs a plain in-memory page copy.

    python scripts/bench_kv_transfer.py [--pages 128] [--repeats 5] [--dtype bfloat16]

The layout defaults to a Llama-3-8B-like one (32 layers, 8 KV heads x 128, 16-token pages: 2 MiB per
bf16 page; a 2k-token prompt is 128 pages). The sender runs in a child process with its own pool (as a
prefill server would), the receiver here; each repeat is one transfer of `--pages` pages, timed from
`send` to the receiver's event. Baselines, interleaved with it: a plain memory copy of the same number
of bytes (`Tensor.copy_` of one contiguous buffer: the ceiling), and the same pages copied between two
pools in one process with `read_pages` + `write_pages` (moving pages with no wire at all).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time

import torch

from hearth.kv.pool import KVLayout, KVPool
from hearth.kv_transfer import make_transport
from hearth.kv_transfer.base import ReceiveSpec, SendSpec
from hearth.kv_transfer.connector import PoolPageSource, pool_sink, wire_layout

SECRET = b"bench"


def layout_from(args: argparse.Namespace) -> KVLayout:
    return KVLayout(args.layers, args.kv_heads, args.head_dim, args.page_size, getattr(torch, args.dtype))


def sender_main(args: argparse.Namespace, endpoint: str, jobs: mp.Queue, done: mp.Queue) -> None:
    torch.set_num_threads(1)
    pool = KVPool(layout_from(args), args.pages)
    pool.storage.normal_()
    transport = make_transport("tcp", wire_layout(pool.layout), SECRET, 60.0, pool_sink(pool))
    pages = list(range(args.pages))
    while (transfer_id := jobs.get()) is not None:
        transport.send(
            SendSpec(transfer_id, endpoint, PoolPageSource(pool, pages), args.pages * args.page_size, 0)
        )
        while not (events := transport.events()):
            time.sleep(0.0005)
        done.put(events[0].ok)
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
    receiver_pool = KVPool(layout, args.pages)
    receiver_pool.storage.zero_()
    source_pool = KVPool(layout, args.pages)
    source_pool.storage.normal_()
    receiver = make_transport("tcp", wire_layout(layout), SECRET, 60.0, pool_sink(receiver_pool))
    endpoint = receiver.listen("127.0.0.1", 0)
    context = mp.get_context("spawn")
    jobs, done = context.Queue(), context.Queue()
    child = context.Process(target=sender_main, args=(args, endpoint, jobs, done))
    child.start()
    pages = list(range(args.pages))
    total_bytes = args.pages * layout.bytes_per_page
    flat_src = torch.empty(total_bytes, dtype=torch.uint8).random_()
    flat_dst = torch.empty_like(flat_src)
    tcp_s, copy_s, memcpy_s = [], [], []
    for repeat in range(args.repeats + 1):  # the first round warms up (connections, page faults)
        transfer_id = f"bench-{repeat}"
        receiver.open_receive(ReceiveSpec(transfer_id, 0, pages, args.pages * args.page_size - 1, 0))
        started = time.perf_counter()
        jobs.put(transfer_id)
        while not (events := receiver.events()):
            time.sleep(0.0002)
        elapsed = time.perf_counter() - started
        assert events[0].ok and done.get(timeout=60), events
        started = time.perf_counter()
        receiver_pool.write_pages(pages, source_pool.read_pages(pages))
        copied = time.perf_counter() - started
        started = time.perf_counter()
        flat_dst.copy_(flat_src)
        memcopied = time.perf_counter() - started
        if repeat:
            tcp_s.append(elapsed)
            copy_s.append(copied)
            memcpy_s.append(memcopied)
    jobs.put(None)
    child.join(30)
    receiver.close()
    tcp, copy, memcpy = statistics.median(tcp_s), statistics.median(copy_s), statistics.median(memcpy_s)
    print(
        json.dumps(
            {
                "layout": wire_layout(layout).describe(),
                "pages": args.pages,
                "bytes": total_bytes,
                "tcp_median_s": round(tcp, 4),
                "tcp_GBps": round(total_bytes / tcp / 1e9, 3),
                "tcp_pages_per_s": round(args.pages / tcp, 1),
                "memcpy_median_s": round(memcpy, 4),
                "memcpy_GBps": round(total_bytes / memcpy / 1e9, 3),
                "pool_copy_GBps": round(total_bytes / copy / 1e9, 3),
                "tcp_rate_vs_memcpy": round(memcpy / tcp, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
