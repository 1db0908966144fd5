"""CPU cost of a KV transfer's integrity check, one side: the GMAC frame tags (now) against the per-page
xxh3 checksums they replaced, over the transport's real input (scattered pool pages as their runs).

    PYTHONPATH=src python scripts/bench_frame_mac.py [--pages 128] [--repeats 5]

Interleaved in one process, so a noisy machine hits both alike; prints CPU ms per transfer of
`--pages` Llama-3-8B-shaped bf16 pages (2 MiB each).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
import xxhash

from hearth.kv.pool import KVLayout, KVPool
from hearth.kv_transfer.auth import FrameMAC
from hearth.kv_transfer.pool_pages import PoolPageSource

PAGES_PER_BATCH = 4  # 8 MiB batches, as the transport sends them


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pages", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    pool = KVPool(KVLayout(32, 8, 128, 16, torch.bfloat16), 4 * args.pages)
    pool.storage.normal_()
    source = PoolPageSource(pool.io, random.Random(0).sample(range(4 * args.pages), args.pages))
    mac = FrameMAC(bytes(32))

    def gmac() -> None:
        for first in range(0, args.pages, PAGES_PER_BATCH):
            mac.tag(b"header", source.page_runs(first, min(PAGES_PER_BATCH, args.pages - first)))

    def xxh3() -> None:
        for first in range(0, args.pages, PAGES_PER_BATCH):
            count = min(PAGES_PER_BATCH, args.pages - first)
            runs = source.page_runs(first, count)
            per_page = len(runs) // count
            for index in range(count):
                state = xxhash.xxh3_64()
                for run in runs[index * per_page : (index + 1) * per_page]:
                    state.update(run)
                state.intdigest()

    results: dict[str, list[float]] = {"xxh3 checksums (before)": [], "GMAC tags (now)": []}
    for _ in range(args.repeats):
        for name, fn in zip(results, (xxh3, gmac), strict=True):
            started = time.process_time()
            fn()
            results[name].append(time.process_time() - started)
    for name, times in results.items():
        print(f"{name}: {statistics.median(times) * 1e3:.1f} ms CPU per {args.pages} pages")


if __name__ == "__main__":
    main()
