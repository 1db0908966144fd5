"""TTFT of a long prompt served from each KV tier (host RAM, local disk, Redis) vs recomputed.

One process, the bundled demo model on CPU, one engine per tier with a device pool that holds one long
prompt: each repetition sends a fresh prompt P (cold: recomputed, the baseline sample), then a filler
prompt that evicts P from the device, then P again (served from the tier). The tiers are interleaved
within each repetition so machine noise hits them alike. TTFT here is the engine's time to the first
token of `max_tokens=1` (no HTTP). Prints and writes a JSON summary.

    PYTHONPATH=src python scripts/bench_kv_tiers_ttft.py --prompt-len 4000 --reps 3 --redis redis://127.0.0.1:6399
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import statistics
import tempfile
import time

from hearth.engine.llm import LLM
from hearth.engine.sampling_params import SamplingParams

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0)


def build(model: str, num_pages: int, page_bytes: int, threads: int, **tiers: object) -> LLM:
    return LLM(
        model,
        device="cpu",
        num_threads=threads,
        kv_cache_memory_gib=num_pages * page_bytes / (1 << 30),
        **tiers,
    )


def ttft_s(llm: LLM, tokens: list[int]) -> tuple[float, int]:
    started = time.perf_counter()
    result = llm.generate([tokens], ONE_TOKEN)[0]
    return time.perf_counter() - started, result.cached_tokens


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="models/demo")
    parser.add_argument("--prompt-len", type=int, default=4000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--redis", default=None, help="redis://host:port (omit to skip the Redis tier)")
    parser.add_argument("--out", default="bench-results/kv-tiers-ttft.json")
    args = parser.parse_args()
    # A shared store's pages carry MACs under the deployment secret (hearth.kv.tiers.blob_auth).
    os.environ.setdefault("HEARTH_KV_TRANSFER_SECRET", secrets.token_hex(16))

    probe = LLM(args.model, device="cpu", num_threads=args.threads)
    page_size = probe.engine.config.page_size
    page_bytes = probe.engine.worker.kv_pool.layout.bytes_per_page
    vocab = probe.engine.vocab_size
    del probe
    num_pages = -(-(args.prompt_len + 1) // page_size) + 8  # one prompt (and its answer) and a little
    disk_dir = tempfile.mkdtemp(prefix="hearth-kv-bench-")
    engines = {
        "host": build(args.model, num_pages, page_bytes, args.threads, kv_offload_memory_gib=1.0),
        "disk": build(
            args.model, num_pages, page_bytes, args.threads, kv_disk_dir=disk_dir, kv_disk_size_gib=4
        ),
    }
    if args.redis:
        engines["redis"] = build(args.model, num_pages, page_bytes, args.threads, kv_store=args.redis)
    rng = random.Random(0)
    samples: dict[str, list[float]] = {"recompute": [], **{name: [] for name in engines}}
    cached: dict[str, list[int]] = {name: [] for name in engines}
    for rep in range(args.reps + 1):  # the first repetition warms up and is not counted
        for name, llm in engines.items():
            stack = llm.engine.kv_loads.connectors["tier"].stack
            prompt = [rng.randrange(10, vocab) for _ in range(args.prompt_len)]
            filler = [rng.randrange(10, vocab) for _ in range(args.prompt_len)]
            cold_s, _ = ttft_s(llm, prompt)
            stack.flush()
            llm.generate([filler], ONE_TOKEN)  # evicts the prompt's pages from the device
            stack.flush()
            warm_s, hit = ttft_s(llm, prompt)
            if rep:
                samples["recompute"].append(cold_s)
                samples[name].append(warm_s)
                cached[name].append(hit)
    for llm in engines.values():
        llm.engine.close()
    recompute = statistics.median(samples["recompute"])
    summary = {
        "prompt_len": args.prompt_len,
        "reps": args.reps,
        "threads": args.threads,
        "median_ttft_s": {name: statistics.median(values) for name, values in samples.items()},
        "speedup_vs_recompute": {
            name: recompute / statistics.median(values)
            for name, values in samples.items()
            if name != "recompute"
        },
        "cached_tokens": cached,
        "samples_s": samples,
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "samples_s"}, indent=2))

    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as file:
        json.dump(summary, file, indent=2)


if __name__ == "__main__":
    main()
