"""Times the LM-head product three ways on this CPU: F.linear on the checkpoint layout, a
[hidden, vocab] copy through MKL, and oneDNN with a prepacked weight. It is why
`CausalLM.prepare_for_inference` picks what it picks.

    python scripts/bench_lm_head.py --threads 1 --vocab 32000 --hidden 512
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--rows", default="1,2,4,16,64")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    weight = torch.randn(args.vocab, args.hidden)
    weight_t = weight.t().contiguous()
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    print(f"{'rows':>5} {'F.linear ms':>12} {'x @ W^T ms':>12} {'oneDNN ms':>12}")
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, args.hidden)
        ways = {
            "linear": lambda x=x: F.linear(x, weight),
            "gemv": lambda x=x: x @ weight_t,
            "onednn": lambda x=x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
        }
        best = {}
        for _ in range(4):  # interleaved rounds; keep each way's best
            for name, fn in ways.items():
                start = time.perf_counter()
                for _ in range(args.repeats):
                    fn()
                elapsed_ms = (time.perf_counter() - start) / args.repeats * 1e3
                best[name] = min(best.get(name, elapsed_ms), elapsed_ms)
        print(f"{rows:>5} {best['linear']:>12.2f} {best['gemv']:>12.2f} {best['onednn']:>12.2f}")


if __name__ == "__main__":
    main()
