#!/usr/bin/env python
"""This machine's memory bandwidth, STREAM-style, through torch (issue 29: the ceiling batch-1 decode
reads weights against).

Five kernels on float32 arrays far larger than the last-level cache, each timed best of `--repeats`:
    copy   b = a              2 arrays moved per element
    scale  b = s * a          2
    add    c = a + b          3
    triad  a = b + s * c      3
    sum    a.sum()            1 (read only, the closest to a decode step reading its weights)
GB/s counts the bytes STREAM counts (each array read or written once; the write-allocate read of a
destination line is not counted), so the figures compare with STREAM's own.

    PYTHONPATH=src python scripts/bench_memory_bandwidth.py                 # 2 threads, 256 MiB arrays
    PYTHONPATH=src python scripts/bench_memory_bandwidth.py --threads 1 --json /tmp/bw.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from hearth.bench.cpu_info import cpu_info

SCALAR = 3.0


def kernels(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> dict[str, tuple[Callable[[], object], int]]:
    """name -> (one pass, arrays moved per element)."""
    return {
        "copy": (lambda: b.copy_(a), 2),
        "scale": (lambda: torch.mul(a, SCALAR, out=b), 2),
        "add": (lambda: torch.add(a, b, out=c), 3),
        "triad": (lambda: torch.add(b, c, alpha=SCALAR, out=a), 3),
        "sum": (lambda: a.sum(), 1),
    }


def measure(size_mib: float, threads: int, repeats: int) -> dict[str, float]:
    """GB/s (10^9 bytes) per kernel, the best of `repeats` passes after one warm-up pass."""
    torch.set_num_threads(threads)
    num_elements = int(size_mib * 2**20) // 4
    # Filled, not torch.empty: the first touch of each page would otherwise be timed.
    a, b, c = (torch.full((num_elements,), value, dtype=torch.float32) for value in (1.0, 2.0, 0.0))
    results: dict[str, float] = {}
    for name, (run, arrays_moved) in kernels(a, b, c).items():
        run()
        best_s = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            best_s = min(best_s, time.perf_counter() - start)
        results[name] = arrays_moved * a.numel() * a.element_size() / best_s / 1e9
    return results


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-mib", type=float, default=256.0, help="size of each of the 3 arrays (MiB)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10, help="passes per kernel; the best is kept")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    if args.size_mib <= 0 or args.threads < 1 or args.repeats < 1:
        parser.error("--size-mib, --threads and --repeats must be positive")

    cpu = cpu_info()
    print(cpu.describe())
    print(f"torch {torch.__version__}; {args.threads} threads; 3 arrays of {args.size_mib:g} MiB float32")
    results = measure(args.size_mib, args.threads, args.repeats)
    print(f"| kernel | GB/s (best of {args.repeats}) |")
    print("|---|---|")
    for name, gb_s in results.items():
        print(f"| {name} | {gb_s:.1f} |")
    if args.json:
        summary = {
            "cpu": cpu.to_json(),
            "torch": torch.__version__,
            "threads": args.threads,
            "size_mib": args.size_mib,
            "repeats": args.repeats,
            "gb_s": {name: round(gb_s, 2) for name, gb_s in results.items()},
        }
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
