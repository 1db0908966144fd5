"""The fused MoE op (`hearth.ops.moe.fused_moe`) against transformers' own expert loop
(`Qwen3MoeExperts.forward`, one-hot mask + `torch.where` per expert hit) on the same weights and routing,
interleaved A/B rounds, median ms per call. A Qwen3-30B-A3B-shaped layer scaled to fit a shared machine.

    PYTHONPATH=src python scripts/bench_fused_moe.py [--experts 64 --top-k 8 --hidden 1024 --intermediate 384 --threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from hearth.ops.moe import fused_moe


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=384)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        hidden_size=args.hidden,
        moe_intermediate_size=args.intermediate,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
    )
    hf = Qwen3MoeExperts(config).eval()
    with torch.no_grad():
        hf.gate_up_proj.normal_(0, 0.02)
        hf.down_proj.normal_(0, 0.02)
    gate_up, down = hf.gate_up_proj.data, hf.down_proj.data
    print(
        f"experts {args.experts}, top-{args.top_k}, hidden {args.hidden}, intermediate {args.intermediate}, "
        f"float32, torch threads {torch.get_num_threads()}"
    )
    print("| tokens | fused_moe ms | transformers ms | speed-up |")
    print("|---:|---:|---:|---:|")
    for num_tokens in [int(b) for b in args.batches.split(",")]:
        hidden = torch.randn(num_tokens, args.hidden)
        weights, ids = torch.randn(num_tokens, args.experts).softmax(-1).topk(args.top_k, dim=-1)
        with torch.inference_mode():
            ours_out = fused_moe(hidden, gate_up, down, weights, ids)
            torch.testing.assert_close(ours_out, hf(hidden, ids, weights), rtol=1e-4, atol=1e-5)
            ours, theirs = [], []
            for _ in range(args.rounds):  # alternating, so machine noise hits both alike
                start = time.perf_counter()
                fused_moe(hidden, gate_up, down, weights, ids)
                ours.append(time.perf_counter() - start)
                start = time.perf_counter()
                hf(hidden, ids, weights)
                theirs.append(time.perf_counter() - start)
        a, b = statistics.median(ours) * 1e3, statistics.median(theirs) * 1e3
        print(f"| {num_tokens} | {a:.2f} | {b:.2f} | {b / a:.2f}x |")


if __name__ == "__main__":
    main()
