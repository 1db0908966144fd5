"""Overlap scheduling A/B (`hearth.engine.overlap`): the same greedy decode with `async_scheduling` off and
on, alternating runs, output tokens/s per batch size (and whether the tokens are the same).

    python scripts/bench_overlap.py --model models/demo --batch-sizes 1,8,32 --output-len 64
"""

from __future__ import annotations

import argparse
import time

from hearth import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/demo")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    engines = {
        overlap: LLM(args.model, async_scheduling=overlap, device=args.device, max_num_seqs=64)
        for overlap in (False, True)
    }
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    print("batch | serial tok/s | overlapped tok/s | overlapped / serial | same tokens")
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        prompts = [[(7 * i + 13 * r) % 1000 + 5 for i in range(args.input_len)] for r in range(batch)]
        best = {False: 0.0, True: 0.0}
        tokens = {}
        for llm in engines.values():
            llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
        for _ in range(args.repeats):  # alternating, best of each
            for overlap, llm in engines.items():
                start = time.perf_counter()
                results = llm.generate(prompts, params)
                best[overlap] = max(best[overlap], batch * args.output_len / (time.perf_counter() - start))
                tokens[overlap] = [r.token_ids for r in results]
        print(
            f"{batch:5d} | {best[False]:12.1f} | {best[True]:16.1f} | {best[True] / best[False]:19.3f} | "
            f"{tokens[True] == tokens[False]}",
            flush=True,
        )


if __name__ == "__main__":
    main()
