"""What float32 matmuls reach on this CPU: the ceiling under every CPU speed goal (issue 11).

Times one decoder layer's four linears and the LM head of a model's shapes at each row count, through
oneDNN with a prepacked weight (Hearth's path) and through `torch.mm` (MKL), and prints GFLOP/s. With
those rates, a workload's FLOPs say how fast any engine could run it if everything but the matmuls were
free; `docs/benchmarks.md` ("Issue 11, session 6") does that sum for the side-by-side goals.

    PYTHONPATH=src python scripts/bench_cpu_gemm.py --model /tmp/bench-models/llama-tiny-rand --rows 16 64 256 2048
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch


def median_s(fn: Callable[[], object], repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def layer_shapes(config: dict) -> list[tuple[int, int]]:
    """(in, out) of a Llama-style layer's fused qkv, o, fused gate_up and down projections."""
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    kv = config.get("num_key_value_heads", config["num_attention_heads"]) * head_dim
    inter = config["intermediate_size"]
    return [
        (hidden, config["num_attention_heads"] * head_dim + 2 * kv),
        (config["num_attention_heads"] * head_dim, hidden),
        (hidden, 2 * inter),
        (inter, hidden),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="a checkpoint directory (only config.json is read)")
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64, 256, 2048])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = json.loads((Path(args.model) / "config.json").read_text())
    shapes = layer_shapes(config)
    weights = [torch.randn(out, inp) for inp, out in shapes]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
    head = torch.randn(config["vocab_size"], config["hidden_size"])
    head_packed = torch.ops.mkldnn._reorder_linear_weight(head, None)

    def run(x: torch.Tensor, weight: torch.Tensor, prepacked: torch.Tensor) -> tuple[float, float]:
        onednn = median_s(
            lambda: torch.ops.mkldnn._linear_pointwise(x, prepacked, None, "none", [], ""), args.repeats
        )
        mkl = median_s(lambda: torch.mm(x, weight.t()), args.repeats)
        return onednn, mkl

    print(f"{torch.get_num_threads()} threads; shapes (in, out) {shapes}; LM head {tuple(head.shape[::-1])}")
    for rows in args.rows:
        layer_flop = sum(2 * rows * inp * out for inp, out in shapes)
        onednn = mkl = 0.0
        for (inp, _), weight, prepacked in zip(shapes, weights, packed):
            a, b = run(torch.randn(rows, inp), weight, prepacked)
            onednn, mkl = onednn + a, mkl + b
        head_flop = 2 * rows * head.shape[0] * head.shape[1]
        head_onednn, head_mkl = run(torch.randn(rows, head.shape[1]), head, head_packed)
        print(
            f"rows {rows:5d}: layer oneDNN {onednn * 1e3:7.2f} ms {layer_flop / onednn / 1e9:5.0f} GFLOP/s,"
            f" MKL {mkl * 1e3:7.2f} ms {layer_flop / mkl / 1e9:5.0f} GFLOP/s;"
            f" LM head oneDNN {head_flop / head_onednn / 1e9:5.0f}, MKL {head_flop / head_mkl / 1e9:5.0f} GFLOP/s",
            flush=True,
        )


if __name__ == "__main__":
    main()
