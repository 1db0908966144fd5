"""INT4 (W4A8 and W4A16) vs bf16 skinny linear kernels per weight shape, interleaved, and the INT4 weight
dequantized for a float GEMM per call (what rows past the kernel's limit once took) or once, kept dense (float32 GEMM:
what float activations could have at the cost of the memory); the fastest single call of
`--rounds` rounds per side (on a shared machine the minimum is the least disturbed run). W4A8 applies up to
`INT4_MAX_ROWS` rows (float activations above, as `int4_linear` chooses).

    TORCH_EXTENSIONS_DIR=/tmp/k python scripts/bench_int4_linear.py --shapes 2816x512 32000x512 --rows 1 4 16
    python scripts/bench_int4_linear.py --shapes 960x576 3072x576 576x1536 --rows 1 16 64 256 --group-size 32
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch
import torch.nn.functional as F

from hearth.ops import cpu_kernels
from hearth.ops.int4 import dequantize_int4, int4_linear, make_int4_weights, quantize_rtn
from hearth.ops.linear import linear, prepare_linear_weights


def timed(fn, repeats: int) -> float:
    """The fastest of `repeats` calls, each timed alone: on a loaded machine a block of calls longer than a
    scheduler slice always includes other processes' time, one short call often does not."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="+", default=["1024x512", "2816x512", "512x1408", "32000x512"])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 4, 8, 16])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--group-size", type=int, default=128, help="INT4 group (GGUF's 4-bit types: 32)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu_kernels.paged_decode_attention_kernel(wait=True)
    print(
        "| out x in | rows | bf16 us | int4 W4A16 us | int4 W4A8 us | dequantized + GEMM us | dense fp32 GEMM us "
        "| bf16 / W4A16 | bf16 / W4A8 | dequantized / W4A16 | dense / W4A16 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for shape in args.shapes:
        out, k = map(int, shape.split("x"))
        weight = torch.randn(out, k).to(torch.bfloat16).float()
        dense = prepare_linear_weights(weight)
        q, scales, zeros = quantize_rtn(weight, args.group_size)
        int4 = dataclasses.replace(
            make_int4_weights(q, scales, zeros, args.group_size), int8_activations=True
        )
        int4_f32 = dataclasses.replace(int4, int8_activations=False)
        dense_f32 = dequantize_int4(int4_f32)
        for rows in args.rows:
            x = torch.randn(rows, k)
            repeats = max(3, int(2e7 / (out * k)))
            bf16_s, f32_s, int4_s, deq_s, dense_s = [], [], [], [], []
            for _ in range(args.rounds):
                bf16_s.append(timed(lambda x=x, dense=dense: linear(x, dense, None), repeats))
                f32_s.append(timed(lambda x=x, w=int4_f32: int4_linear(x, w, None), repeats))
                int4_s.append(timed(lambda x=x, int4=int4: int4_linear(x, int4, None), repeats))
                deq_s.append(timed(lambda x=x, w=int4_f32: F.linear(x, dequantize_int4(w)), repeats))
                dense_s.append(timed(lambda x=x, w=dense_f32: F.linear(x, w), repeats))
            b, f, i, d, g = (min(s) * 1e6 for s in (bf16_s, f32_s, int4_s, deq_s, dense_s))
            print(
                f"| {shape} | {rows} | {b:.0f} | {f:.0f} | {i:.0f} | {d:.0f} | {g:.0f} | {b / f:.2f}x | {b / i:.2f}x "
                f"| {d / f:.2f}x | {g / f:.2f}x |"
            )


if __name__ == "__main__":
    main()
