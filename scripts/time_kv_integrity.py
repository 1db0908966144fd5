"""What the KV integrity check costs a decode step, measured in one process, on and off alternating.

    TORCH_EXTENSIONS_DIR=/tmp/k python scripts/time_kv_integrity.py --model /tmp/bench-models/llama-tiny-rand

One engine, `--batch` running requests with `--prompt-len`-token prompts. Steps alternate in pairs between
checking on and off (the builder's expected tags and the worker's tracker switched together), so machine
noise hits both sides alike; reported: the median step time of each side, their ratio, and the check's own
time (builder padding + `BatchedPageTagCheck.check` on that step's input) as a share of the step.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from hearth import LLM, SamplingParams
from hearth.engine.messages import EngineRequest
from hearth.kv.integrity import BatchedPageTagCheck, NoPageTagCheck
from hearth.ops import cpu_kernels


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--pairs", type=int, default=60, help="on/off step pairs")
    args = parser.parse_args()
    llm = LLM(args.model, max_num_seqs=args.batch, kv_integrity=True)
    cpu_kernels.paged_decode_attention_kernel(wait=True)
    cpu_kernels.bf16_skinny_linear_kernel(wait=True)
    engine = llm.engine
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=2 * args.pairs + 32, ignore_eos=True)
    for index in range(args.batch):
        prompt = [rng.randrange(vocab) for _ in range(args.prompt_len)]
        engine.add_request(EngineRequest(f"r{index}", prompt, params))
    for _ in range(8):  # prefill, then a few decode steps
        engine.step()
    worker, builder = engine.worker, engine.step_inputs
    checking, off = BatchedPageTagCheck(), NoPageTagCheck()
    times: dict[bool, list[float]] = {True: [], False: []}
    order_rng = random.Random(1)
    for _ in range(args.pairs):
        # A random order per pair: a fixed alternation has period 4 steps, which divides the page size, so
        # every step that allocates a new page (slower) fell on the same side and biased the ratio ~3%.
        for on in order_rng.sample((True, False), 2):
            worker.page_tag_check = checking if on else off
            builder.check_page_tags = on
            start = time.perf_counter()
            engine.step()
            times[on].append(time.perf_counter() - start)
    # The integrity work alone, on this batch: the builder's expected tags (build with them minus without,
    # alternating) and the worker's check.
    scheduled = [row for row in engine.scheduler.schedule().scheduled]
    build_s: dict[bool, list[float]] = {True: [], False: []}
    for index in range(400):
        on = index % 2 == 0
        builder.check_page_tags = on
        start = time.perf_counter()
        step = builder.build(scheduled)
        build_s[on].append(time.perf_counter() - start)
    builder.check_page_tags = True
    step = builder.build(scheduled)
    check_s = []
    for _ in range(400):
        start = time.perf_counter()
        checking.check(worker.kv_pool.page_tags, step.page_table, step.page_table_width, step.page_tags)
        check_s.append(time.perf_counter() - start)
    on_ms, off_ms = statistics.median(times[True]) * 1e3, statistics.median(times[False]) * 1e3
    check_ms = statistics.median(check_s) * 1e3
    tags_ms = max(0.0, statistics.median(build_s[True]) - statistics.median(build_s[False])) * 1e3
    work_ms = check_ms + tags_ms
    print(
        f"batch {args.batch}, {step.page_table_width} pages per row ({len(step.page_table)} entries): "
        f"step median on {on_ms:.2f} ms, off {off_ms:.2f} ms, on/off {on_ms / off_ms:.4f} "
        f"(load average {os.getloadavg()[0]:.1f}); integrity work per step {work_ms * 1e3:.1f} us "
        f"(check {check_ms * 1e3:.1f} us, expected tags in the builder {tags_ms * 1e3:.1f} us) "
        f"= {100 * work_ms / off_ms:.3f}% of a step"
    )


if __name__ == "__main__":
    main()
