"""Peak decode throughput when the KV cache is the limit: more requests than a BF16 cache holds at once,
BF16 KV against FP8 KV in the same memory, alternating rounds in one process (the machine is shared).

    TORCH_EXTENSIONS_DIR=/tmp/k python scripts/bench_kv_bound.py --model models/demo --kv-cache-memory 0.009 \
        --num-prompts 48 --input-len 128 --output-len 128 --rounds 2

Each round generates every prompt's `--output-len` tokens (greedy, EOS ignored); throughput is output
tokens over wall time; the best round per configuration is reported, with the ratio.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from hearth import LLM, SamplingParams
from hearth.ops import cpu_kernels


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--kv-cache-memory", type=float, default=0.009, help="GiB, the same for both")
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "fp8_e4m3"])
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads (default: all cores)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    cpu_kernels.paged_decode_attention_kernel(wait=True)
    llms = {
        dtype: LLM(
            args.model,
            kv_cache_dtype=dtype,
            kv_cache_memory_gib=args.kv_cache_memory,
            max_num_seqs=args.num_prompts,
            enable_prefix_caching=False,
            num_threads=args.num_threads,
        )
        for dtype in args.dtypes
    }
    rng = random.Random(0)
    vocab = next(iter(llms.values())).engine.model_config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    best: dict[str, float] = {}
    for _ in range(args.rounds):
        for dtype, llm in llms.items():
            start = time.perf_counter()
            results = llm.generate(prompts, params)
            elapsed = time.perf_counter() - start
            tokens = sum(len(r.token_ids) for r in results)
            best[dtype] = max(best.get(dtype, 0.0), tokens / elapsed)
    base = args.dtypes[0]
    report = {
        dtype: {
            "kv_tokens": llm.engine.num_kv_tokens,
            "output_tokens_per_s": best[dtype],
            "ratio": best[dtype] / best[base],
        }
        for dtype, llm in llms.items()
    }
    for dtype, row in report.items():
        print(
            f"{dtype}: {row['kv_tokens']} KV tokens, {row['output_tokens_per_s']:.1f} output tok/s ({row['ratio']:.2f}x)"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": report}, f, indent=2)


if __name__ == "__main__":
    main()
