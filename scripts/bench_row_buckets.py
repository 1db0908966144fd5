"""Throughput with and without row-count buckets for oneDNN matmuls (issue 19), A/B interleaved in one process.

    PYTHONPATH=src python scripts/bench_row_buckets.py [--model models/demo] [--rounds 3]

Two workloads on one engine: "offline" (every request submitted at once) and "c16" (16 in flight, a new one
as each finishes); random prompt lengths 16..1024 tokens and 32 answer tokens, so steps see many row counts.
Every round runs both variants on the same requests (prefix caching off, so each round prefills again, and
the exact variant finds its per-shape primitives already built: this measures the padding's own cost),
order alternating, after a warm-up round of each; the script prints generated tokens/s per variant and the ratio buckets/exact of the medians.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from hearth.engine.config import EngineConfig
from hearth.engine.engine import Engine
from hearth.engine.factory import build_engine
from hearth.engine.messages import EngineRequest
from hearth.engine.sampling_params import SamplingParams
from hearth.ops import row_buckets

DEMO_MODEL = Path(__file__).resolve().parent.parent / "models" / "demo"


def run_load(engine: Engine, num_requests: int, concurrency: int, seed: int, vocab_size: int) -> float:
    """Generated tokens per second with at most `concurrency` requests in flight."""
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(3, vocab_size) for _ in range(rng.randint(16, 1024))] for _ in range(num_requests)
    ]
    params = SamplingParams(max_tokens=32, ignore_eos=True, temperature=0.0)
    submitted = finished = generated = 0
    in_flight: set[str] = set()
    started = time.perf_counter()
    while finished < num_requests:
        while len(in_flight) < concurrency and submitted < num_requests:
            request_id = f"{seed}-{submitted}"
            engine.add_request(EngineRequest(request_id, prompts[submitted], params))
            in_flight.add(request_id)
            submitted += 1
        for output in engine.step():
            generated += len(output.new_token_ids)
            if output.finish_reason is not None:
                in_flight.discard(output.request_id)
                finished += 1
    return generated / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=str(DEMO_MODEL))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    engine = build_engine(
        EngineConfig(model=args.model, kv_cache_memory_gib=0.5, enable_prefix_caching=False)
    )
    vocab_size = engine.vocab_size
    workloads = {"offline": 10**6, "c16": 16}
    results: dict[tuple[str, bool], list[float]] = {(w, b): [] for w in workloads for b in (True, False)}
    for round_index in range(-1, args.rounds):  # round -1 warms both variants up (kernels, primitives)
        order = (True, False) if round_index % 2 == 0 else (False, True)
        for name, concurrency in workloads.items():
            for enabled in order:
                row_buckets.ENABLED = enabled
                rate = run_load(engine, args.num_requests, concurrency, args.seed, vocab_size)
                if round_index >= 0:
                    results[(name, enabled)].append(rate)
                print(
                    f"round {round_index} {name:8} {'buckets' if enabled else 'exact':8} {rate:8.1f} tok/s",
                    flush=True,
                )
    for name in workloads:
        on, off = statistics.median(results[(name, True)]), statistics.median(results[(name, False)])
        print(f"{name}: buckets {on:.1f} tok/s, exact {off:.1f} tok/s, ratio {on / off:.3f}")


if __name__ == "__main__":
    main()
