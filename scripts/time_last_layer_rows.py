"""A prefill step with the last layer finishing only the sampled rows, against every row (A/B in one process).

`CausalLM._last_layer_rows` picks the rows; the "full" arm replaces it with one that returns None. Each
round prefills 8 new prompts of `--prompt-len` random tokens in one step, the two arms in alternating order.

    PYTHONPATH=src python scripts/time_last_layer_rows.py --model /tmp/bench-models/llama-tiny-rand
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from hearth import LLM, SamplingParams
from hearth.engine.messages import EngineRequest
from hearth.model.decoder import CausalLM
from hearth.ops import cpu_kernels


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    step_tokens = args.prompts_per_step * args.prompt_len
    llm = LLM(args.model, max_model_len=max(2048, args.prompt_len + 8), max_num_batched_tokens=step_tokens)
    cpu_kernels.paged_decode_attention_kernel(wait=True)
    engine = llm.engine
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    pruned = CausalLM._last_layer_rows
    num_sent = 0

    def prefill_step_s() -> float:
        nonlocal num_sent
        for _ in range(args.prompts_per_step):
            prompt = [rng.randrange(vocab) for _ in range(args.prompt_len)]
            engine.add_request(EngineRequest(f"r{num_sent}", prompt, params))
            num_sent += 1
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        while engine.has_work:
            engine.step()
        return elapsed

    times: dict[str, list[float]] = {"pruned": [], "full": []}
    try:
        for index in range(args.rounds + 2):
            for arm in ("full", "pruned") if index % 2 == 0 else ("pruned", "full"):
                CausalLM._last_layer_rows = pruned if arm == "pruned" else (lambda self, rows, num_rows: None)
                elapsed = prefill_step_s()
                if index >= 2:  # the first rounds warm both arms up
                    times[arm].append(elapsed)
    finally:
        CausalLM._last_layer_rows = pruned
    on, off = statistics.median(times["pruned"]), statistics.median(times["full"])
    print(
        f"prefill step of {step_tokens} tokens: last layer on sampled rows {on * 1e3:.0f} ms,"
        f" on every row {off * 1e3:.0f} ms, every/sampled {off / on:.3f}"
    )


if __name__ == "__main__":
    main()
