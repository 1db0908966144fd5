#!/usr/bin/env python
"""Time the bf16 linear paths of issue 11 on this CPU, interleaved in one process: torch's generic
`F.linear` in bf16 (what a bf16 model ran before), the oneDNN-prepacked bf16 weight
(`hearth.ops.linear_bf16`), and float32 with a prepacked weight (the AVX2 path) for reference.

Shapes are the 40M bench Llama's (hidden 512, intermediate 1408, vocab 32000); rows 1 and 64 are decode
at batch 1 and 64, 1024 a prefill chunk. Prints one line per (shape, rows) and the whole-step sum.

    PYTHONPATH=src python scripts/bench_bf16_linear.py --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from hearth.ops.cpu_capability import detect_cpu_capability

# (name, in, out, calls per decode step) for the 8-layer bench Llama.
SHAPES = [
    ("qkv", 512, 1024, 8),
    ("o", 512, 512, 8),
    ("gate_up", 512, 2816, 8),
    ("down", 1408, 512, 8),
    ("lm_head", 512, 32000, 1),
]


def per_call_s(fn, min_time_s: float) -> float:
    fn()
    fn()
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_time_s:
            return elapsed / calls


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64, 1024])
    parser.add_argument("--min-time-s", type=float, default=0.2)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cap = detect_cpu_capability()
    print(cap.describe(), f"threads {args.threads}", flush=True)
    can_pack_bf16 = cap.onednn_bf16
    totals: dict[tuple[int, str], float] = {}
    for rows in args.rows:
        for name, n_in, n_out, calls in SHAPES:
            w32 = torch.randn(n_out, n_in) * 0.05
            w16 = w32.to(torch.bfloat16)
            x16 = torch.randn(rows, n_in).to(torch.bfloat16)
            x32 = x16.float()
            paths = {"F.linear bf16": lambda x16=x16, w16=w16: F.linear(x16, w16)}
            if can_pack_bf16:
                packed16 = torch.ops.mkldnn._reorder_linear_weight(w16, None)
                paths["prepacked bf16"] = lambda x16=x16, p=packed16: torch.ops.mkldnn._linear_pointwise(
                    x16, p, None, "none", [], ""
                )
            packed32 = torch.ops.mkldnn._reorder_linear_weight(w32, None)
            paths["prepacked fp32"] = lambda x32=x32, p=packed32: torch.ops.mkldnn._linear_pointwise(
                x32, p, None, "none", [], ""
            )
            best: dict[str, float] = {}
            for _ in range(args.rounds):  # interleaved rounds; keep each path's best
                for label, fn in paths.items():
                    best[label] = min(best.get(label, float("inf")), per_call_s(fn, args.min_time_s))
            for label, seconds in best.items():
                totals[(rows, label)] = totals.get((rows, label), 0.0) + seconds * calls
            base = best["F.linear bf16"]
            print(
                f"rows {rows:5d} {name:8s} "
                + "  ".join(
                    f"{label} {seconds * 1e6:9.1f} us ({base / seconds:5.2f}x)"
                    for label, seconds in best.items()
                ),
                flush=True,
            )
    for rows in args.rows:
        base = totals[(rows, "F.linear bf16")]
        print(
            f"step rows {rows:5d}: "
            + "  ".join(
                f"{label} {totals[(r, label)] * 1e3:8.2f} ms ({base / totals[(r, label)]:5.2f}x)"
                for (r, label) in totals
                if r == rows
            )
        )


if __name__ == "__main__":
    main()
