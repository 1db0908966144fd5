"""TTFT added by prefill/decode disaggregation: the same prompts through a router in front of one mixed
server (A) and a router in front of a prefill + a decode server (B), interleaved A/B.

    python scripts/bench_pd_ttft.py --a http://127.0.0.1:8001 --b http://127.0.0.1:8002 \
        --lengths 256 2048 8192 --repeats 5

Each prompt is fresh random token ids (no prefix-cache hits on either side); TTFT is the time from
sending a streamed completion to its first content chunk. Prints one JSON line per length.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import httpx


def ttft_s(client: httpx.Client, url: str, prompt: list[int]) -> float:
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True, "stream": True}
    started = time.perf_counter()
    with client.stream("POST", url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and '"text"' in line:
                return time.perf_counter() - started
    raise RuntimeError("no token came back")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--a", required=True, help="baseline (mixed) base URL")
    parser.add_argument("--b", required=True, help="PD base URL")
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 2048, 8192])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--vocab", type=int, default=400, help="token ids are drawn below this")
    args = parser.parse_args()
    rng = random.Random(0)
    with httpx.Client(timeout=600) as client:
        for url in (args.a, args.b):  # warm up both paths (connections, first-step costs)
            ttft_s(client, url, [rng.randrange(3, args.vocab) for _ in range(64)])
        for length in args.lengths:
            times: dict[str, list[float]] = {"a": [], "b": []}
            for repeat in range(args.repeats):
                order = ("a", "b") if repeat % 2 == 0 else ("b", "a")
                for side in order:
                    prompt = [rng.randrange(3, args.vocab) for _ in range(length)]
                    times[side].append(ttft_s(client, getattr(args, side), prompt))
            a, b = statistics.median(times["a"]), statistics.median(times["b"])
            print(
                json.dumps(
                    {
                        "prompt_tokens": length,
                        "mixed_ttft_ms": round(a * 1000, 1),
                        "pd_ttft_ms": round(b * 1000, 1),
                        "pd_added_pct": round((b / a - 1) * 100, 1),
                        "mixed_all_ms": [round(t * 1000) for t in times["a"]],
                        "pd_all_ms": [round(t * 1000) for t in times["b"]],
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
