"""Times decode attention over a paged KV pool two ways on this CPU: the compiled kernel
(`hearth.ops.cpu_kernels`, pages read in place) and the torch path (pages gathered, then SDPA).

    python scripts/bench_decode_attention.py --threads 1 --seqs 64 --context 300
"""

from __future__ import annotations

import argparse
import time

import torch

from hearth.engine.forward_batch import ForwardBatch
from hearth.kv.pool import KVLayout, KVPool
from hearth.ops import cpu_kernels
from hearth.ops.attention.cpu import CpuBackend


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernel = cpu_kernels.paged_decode_attention_kernel(wait=True)
    if kernel is None:
        raise SystemExit("the kernel could not be built here")
    page_size = args.page_size
    max_pages = -(-args.context // page_size)
    num_pages = args.seqs * max_pages
    pool = KVPool(KVLayout(1, args.kv_heads, args.head_dim, page_size, torch.float32), num_pages)
    pool.storage.normal_()
    # Decode allocates one page per sequence in turn, so a sequence's pages interleave with the others'.
    table = torch.arange(num_pages).view(max_pages, args.seqs).t().contiguous()
    step = ForwardBatch(
        token_ids=[0] * args.seqs,
        positions=[args.context - 1] * args.seqs,
        query_start_loc=list(range(args.seqs + 1)),
        seq_lens=[args.context] * args.seqs,
        num_decode_rows=args.seqs,
        page_table=table.flatten().tolist(),
        page_table_width=max_pages,
        slot_mapping=[0] * args.seqs,
        logits_indices=[],
        sampling=[],
    )
    backend = CpuBackend(
        device="cpu", page_size=page_size, max_num_seqs=args.seqs, max_pages_per_seq=max_pages
    )
    q = torch.randn(args.seqs, args.heads, args.head_dim)
    scale = args.head_dim**-0.5
    best: dict[str, float] = {}
    for _ in range(3):  # interleaved rounds; keep each way's best
        for name in ("kernel", "torch"):
            cpu_kernels._kernel = kernel if name == "kernel" else None
            metadata = backend.prepare(step)  # once per step; it picks the kernel or the torch path
            start = time.perf_counter()
            for _ in range(args.repeats):
                backend.forward(0, q, None, None, pool, metadata, scale)
            elapsed_ms = (time.perf_counter() - start) / args.repeats * 1e3
            best[name] = min(best.get(name, elapsed_ms), elapsed_ms)
    print(
        f"kernel {best['kernel']:.2f} ms, torch {best['torch']:.2f} ms per layer ({best['torch'] / best['kernel']:.1f}x)"
    )


if __name__ == "__main__":
    main()
