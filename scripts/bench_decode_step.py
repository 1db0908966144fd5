"""A/B of one engine fast path, in one process: decode steps alternately with it on and off.

    python scripts/bench_decode_step.py --model /tmp/bench-models/llama-tiny-rand --batch 64 \\
        --prompt-len 128 --threads 1 --toggle kernel|bf16|norm|rotary

Prints the median and best step time of each side over interleaved rounds, and their ratio.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch

from hearth import LLM, SamplingParams
from hearth.engine.engine import Engine
from hearth.engine.messages import EngineRequest
from hearth.model.layers import Linear
from hearth.ops import cpu_kernels


def toggles(engine: Engine, name: str) -> Callable[[bool], None]:
    model = engine.model
    if name == "kernel":
        kernel = cpu_kernels.paged_decode_attention_kernel(wait=True)

        def set_kernel(on: bool) -> None:
            cpu_kernels._kernel = kernel if on else None

        return set_kernel
    if name in ("norm", "rotary"):
        cpu_kernels.paged_decode_attention_kernel(wait=True)
        attribute = "_rms_norm" if name == "norm" else "_rotary_write_kv"
        compiled = getattr(cpu_kernels, attribute)

        def set_compiled(on: bool) -> None:
            setattr(cpu_kernels, attribute, compiled if on else None)

        return set_compiled
    if name == "bf16":
        cpu_kernels.bf16_skinny_linear_kernel(wait=True)
        weights = [m.prepared for m in model.modules() if isinstance(m, Linear)] + [model.lm_head_weights]
        copies = [w.bf16 for w in weights]

        def set_bf16(on: bool) -> None:
            for w, copy in zip(weights, copies):
                w.bf16 = copy if on else None

        return set_bf16
    raise SystemExit(f"unknown toggle {name!r}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--toggle", choices=["kernel", "bf16", "norm", "rotary"], required=True)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    llm = LLM(args.model, max_num_seqs=args.batch, num_threads=args.threads)
    engine = llm.engine
    switch = toggles(engine, args.toggle)
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    max_tokens = 2 * args.rounds * args.steps + 8
    for index in range(args.batch):
        prompt = [rng.randrange(vocab) for _ in range(args.prompt_len)]
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        engine.add_request(EngineRequest(f"bench-{index}", prompt, params))
    while engine.scheduler.waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
    ):
        engine.step()
    times: dict[str, list[float]] = {"on": [], "off": []}
    for _ in range(args.rounds):
        for side in ("on", "off"):
            switch(side == "on")
            start = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            times[side].append((time.perf_counter() - start) / args.steps * 1e3)
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    print(
        f"{args.toggle}: on {on:.1f} ms (best {min(times['on']):.1f}), off {off:.1f} ms "
        f"(best {min(times['off']):.1f}) per step; on/off {on / off:.2f}x "
        f"(batch {args.batch}, prompt {args.prompt_len}, {args.threads} thread(s), torch {torch.__version__})"
    )


if __name__ == "__main__":
    main()
