"""Time an in-process decode step (batch of running requests, compiled kernels ready), and profile it.

Works against this checkout and against an older one (run it with `PYTHONPATH=OTHER/src`), so two
checkouts can be compared back to back on the same machine:

    TORCH_EXTENSIONS_DIR=/tmp/k-new python scripts/time_decode_step.py --model /tmp/bench-models/llama-tiny-rand
    TORCH_EXTENSIONS_DIR=/tmp/k-old PYTHONPATH=OLD/src python scripts/time_decode_step.py --model ...
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import time

from hearth import LLM, SamplingParams
from hearth.ops import cpu_kernels


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--profile-rows", type=int, default=14, help="0: no profile")
    args = parser.parse_args()
    llm = LLM(args.model, max_num_seqs=args.batch)
    cpu_kernels.paged_decode_attention_kernel(wait=True)
    cpu_kernels.bf16_skinny_linear_kernel(wait=True)
    engine = llm.engine
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=args.steps * 3 + 16, ignore_eos=True)
    for index in range(args.batch):
        prompt = [rng.randrange(vocab) for _ in range(args.prompt_len)]
        try:
            from hearth.engine.messages import EngineRequest

            engine.add_request(EngineRequest(f"r{index}", prompt, params))
        except ImportError:  # a checkout from before the engine-core split
            engine.add_request(prompt, params)
    for _ in range(8):  # prefill, then a few decode steps to warm up
        engine.step()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    print(f"decode step at batch {args.batch}: {(time.perf_counter() - start) / args.steps * 1e3:.1f} ms")
    if args.profile_rows:
        profile = cProfile.Profile()
        profile.runcall(lambda: [engine.step() for _ in range(args.steps // 2)])
        pstats.Stats(profile).sort_stats("tottime").print_stats(args.profile_rows)


if __name__ == "__main__":
    main()
