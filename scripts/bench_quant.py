"""Decode-step time of weight/KV precision configurations, interleaved in one process (the machine is shared
and noisy: each round times every configuration once, and the median per configuration is reported).

    TORCH_EXTENSIONS_DIR=/tmp/k python scripts/bench_quant.py --model /tmp/bench-models/llama-tiny-rand \
        --configs auto:auto int4:auto --batches 1 4 16

A configuration is `WEIGHTS:KV` (`--quantization`, `--kv-cache-dtype`); `int4@float` is `int4` with the kernel's
activations kept float32 (`HEARTH_INT4_ACTIVATIONS=float`, W4A16) instead of int8 (W4A8). Prints a Markdown table and, with
`--json`, writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

from hearth import LLM, SamplingParams
from hearth.engine.messages import EngineRequest
from hearth.ops import cpu_kernels


def start_batch(llm: LLM, batch: int, prompt_len: int, max_tokens: int, tag: str) -> None:
    engine = llm.engine
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for index in range(batch):
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        engine.add_request(EngineRequest(f"{tag}-{index}", prompt, params))
    while any(not r.output_token_ids for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--configs", nargs="+", default=["auto:auto", "int4:auto"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 4, 16])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8, help="decode steps timed per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads (default: all cores)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    cpu_kernels.paged_decode_attention_kernel(wait=True)
    llms = {}
    for config in args.configs:
        weights, kv = config.split(":")
        weights, _, activations = weights.partition("@")
        os.environ["HEARTH_INT4_ACTIVATIONS"] = activations or "int8"  # read as the layers are built
        llms[config] = LLM(
            args.model,
            quantization=weights,
            kv_cache_dtype=kv,
            max_num_seqs=max(args.batches),
            num_threads=args.num_threads,
        )
        os.environ.pop("HEARTH_INT4_ACTIVATIONS")
    results: dict[str, dict[int, float]] = {config: {} for config in args.configs}
    for batch in args.batches:
        budget = args.steps * (args.rounds + 2) + 8
        for llm in llms.values():
            start_batch(llm, batch, args.prompt_len, budget, f"b{batch}")
            for _ in range(2):
                llm.engine.step()
        times: dict[str, list[float]] = {config: [] for config in args.configs}
        for _ in range(args.rounds):
            for config, llm in llms.items():
                start = time.perf_counter()
                for _ in range(args.steps):
                    llm.engine.step()
                times[config].append((time.perf_counter() - start) / args.steps)
        for config, llm in llms.items():
            while (
                llm.engine.has_unfinished()
                if hasattr(llm.engine, "has_unfinished")
                else llm.engine.scheduler.running
            ):
                llm.engine.step()
            results[config][batch] = statistics.median(times[config]) * 1e3
    base = args.configs[0]
    print("| config | " + " | ".join(f"batch {b} ms/step (x{base})" for b in args.batches) + " |")
    print("|---|" + "---|" * len(args.batches))
    for config in args.configs:
        cells = [
            f"{results[config][b]:.2f} ({results[base][b] / results[config][b]:.2f}x)" for b in args.batches
        ]
        print(f"| {config} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "ms_per_step": results}, f, indent=2)


if __name__ == "__main__":
    main()
