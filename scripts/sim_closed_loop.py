"""The `hearth bench serve` c16 workload without the server: an in-process closed loop over one engine.

Keeps `--concurrency` requests in flight (random prompt ids, `--input-len` in, `--output-len` out,
greedy, EOS ignored); each finished request is replaced at once. Prints output tok/s, TTFT p50/p90
(time from `add_request` to the step that returned its first token) and how the steps split into long
(prefill) and short (decode) ones. Set against a `hearth bench serve` run of the same shape, the
difference is what the API process, the sockets and the engine-core process's environment cost.

    PYTHONPATH=src python scripts/sim_closed_loop.py --model /tmp/bench-models/llama-tiny-rand \
        [--max-num-batched-tokens 512] [--ttfts]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from hearth import LLM, SamplingParams
from hearth.engine.messages import EngineRequest
from hearth.ops import cpu_kernels

LONG_STEP_S = 0.1


def run_round(engine, args: argparse.Namespace, tag: str, rng: random.Random) -> None:  # type: ignore[no-untyped-def]
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    arrival_s: dict[str, float] = {}
    ttft_s: dict[str, float] = {}
    num_sent = num_tokens = 0

    def add() -> None:
        nonlocal num_sent
        request_id = f"{tag}{num_sent}"
        prompt = [rng.randrange(vocab) for _ in range(args.input_len)]
        engine.add_request(EngineRequest(request_id, prompt, params))
        arrival_s[request_id] = time.perf_counter()
        num_sent += 1

    for _ in range(min(args.concurrency, args.num_prompts)):
        add()
    step_s: list[float] = []
    start = time.perf_counter()
    while engine.has_work:
        step_start = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        step_s.append(now - step_start)
        for output in outputs:
            num_tokens += len(output.new_token_ids)
            if output.new_token_ids and output.request_id not in ttft_s:
                ttft_s[output.request_id] = now - arrival_s[output.request_id]
            if output.finish_reason is not None and num_sent < args.num_prompts:
                add()
    elapsed = time.perf_counter() - start
    ttfts = sorted(ttft_s.values())
    short = [s for s in step_s if s <= LONG_STEP_S]
    print(
        f"[{tag}] {num_tokens / elapsed:.1f} output tok/s in {elapsed:.2f} s, {len(step_s)} steps;"
        f" TTFT p50 {ttfts[len(ttfts) // 2] * 1e3:.0f} ms, p90 {ttfts[int(len(ttfts) * 0.9)] * 1e3:.0f} ms;"
        f" {len(step_s) - len(short)} steps > {LONG_STEP_S * 1e3:.0f} ms ({elapsed - sum(short):.2f} s),"
        f" the rest median {statistics.median(short) * 1e3 if short else 0:.1f} ms",
        flush=True,
    )
    if args.ttfts:  # in arrival order: shows the waves of a closed loop
        print(" ".join(f"{ttft_s[r]:.2f}" for r in sorted(ttft_s, key=arrival_s.__getitem__)))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--ttfts", action="store_true", help="print every request's TTFT in arrival order")
    args = parser.parse_args()
    llm = LLM(
        args.model, max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens
    )
    cpu_kernels.paged_decode_attention_kernel(wait=True)
    cpu_kernels.bf16_skinny_linear_kernel(wait=True)
    rng = random.Random(0)
    for index in range(args.rounds):
        run_round(llm.engine, args, f"r{index}-", rng)


if __name__ == "__main__":
    main()
