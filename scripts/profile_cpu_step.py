#!/usr/bin/env python
"""Where a CPU engine step's time goes: torch.profiler over one offline batch (prefill and decode of N
prompts), the top ops by self CPU time and the share of wall time outside torch ops (Python, scheduling).

    PYTHONPATH=src python scripts/profile_cpu_step.py --model /tmp/bench-models/llama-tiny-rand \
        --num-prompts 64 --input-len 128 --output-len 32 [--dtype bfloat16] [engine options as key=value]
"""

from __future__ import annotations

import argparse
import random
import time

from torch.profiler import ProfilerActivity, profile


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--no-profile", action="store_true", help="time only (no profiler overhead)")
    args = parser.parse_args()

    from hearth import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, num_threads=args.num_threads, device="cpu")
    rng = random.Random(0)
    vocab = llm.engine.model_config.vocab_size
    prompts = [
        [rng.randrange(10, vocab - 10) for _ in range(args.input_len)] for _ in range(args.num_prompts)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    llm.engine.kv.reset_prefix_cache()
    if args.no_profile:
        start = time.perf_counter()
        llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
        print(f"{args.num_prompts * args.output_len / elapsed:.1f} output tok/s ({elapsed:.2f} s)")
        return
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
    averages = prof.key_averages()
    # Self times of top-level ops only would double count nothing; the sum of all self times is op time.
    op_time_s = sum(event.self_cpu_time_total for event in averages) / 1e6
    print(
        f"wall {elapsed:.2f} s, {args.num_prompts * args.output_len / elapsed:.1f} output tok/s (profiled); "
        f"torch op self time {op_time_s:.2f} s ({100 * op_time_s / elapsed:.0f}% of wall)"
    )
    print(averages.table(sort_by="self_cpu_time_total", row_limit=args.top))


if __name__ == "__main__":
    main()
