"""Times the INT8 kernel as an LM head with its weights cold, as a decode step leaves them: SmolLM2's tied
49,152 x 576 Q8_0 embedding (random values), W8A32 (the file's numerics) and W8A8 (the opt-in), one row, a
64 MiB buffer written before each call to push the weights out of the caches, median of `--calls`; and, for the
memory's floor, a plain sum of the same bytes, equally cold.

    OMP_WAIT_POLICY=PASSIVE python scripts/bench_int8_head_cold.py [--vocab 49152 --hidden 576 --calls 20]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from hearth.ops import cpu_kernels

GROUP = 32


def cold_ms(fn: Callable[[], object], flush: torch.Tensor, calls: int) -> float:
    times = []
    for _ in range(calls):
        flush.add_(1)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    cpu_kernels.paged_decode_attention_kernel(wait=True)
    kernel = cpu_kernels.int8_skinny_linear_kernel()
    if kernel is None:
        raise SystemExit("the CPU kernels could not be built here")
    torch.manual_seed(0)
    q = torch.randint(-127, 128, (args.vocab, args.hidden), dtype=torch.int8)
    scales = torch.rand(args.vocab, args.hidden // GROUP)
    x = torch.randn(1, args.hidden)
    flush = torch.ones(64 * 1024 * 1024 // 8, dtype=torch.int64)
    as_words = q.view(torch.int64)
    w8a32 = cold_ms(lambda: kernel(x, q, scales, GROUP, None, False), flush, args.calls)
    w8a8 = cold_ms(lambda: kernel(x, q, scales, GROUP, None, True), flush, args.calls)
    floor = cold_ms(lambda: as_words.sum(), flush, args.calls)
    print(f"{args.vocab} x {args.hidden} INT8 head, cold, {torch.get_num_threads()} threads, median ms:")
    print(f"W8A32 {w8a32:.2f} | W8A8 {w8a8:.2f} | sum of its {q.numel() / 1e6:.0f} MB {floor:.2f}")


if __name__ == "__main__":
    main()
