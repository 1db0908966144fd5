"""What the KV integrity check costs a decode step, measured in one process, on and off alternating.

    TORCH_EXTENSIONS_DIR=/tmp/k python scripts/time_kv_integrity.py --model /tmp/bench-models/llama-tiny-rand

One engine, `--batch` running requests with `--prompt-len`-token prompts. Steps alternate in pairs between
checking on and off (the builder's expected tags and the worker's tracker switched together), so machine
noise hits both sides alike; reported: the median step time of each side and their ratio, the median of the
per-pair on/off ratios with a bootstrap 95% interval (steps next to each other share the machine's load, so
this is the steadier figure on a busy machine), and the integrity work itself: the check as timed inside
the step loop (cold: right after the previous forward, where it actually runs), the same check repeated back
to back (hot), and the builder's expected tags.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch

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
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads (0: torch's default). On a busy machine, 1 with the main thread's CPU time (also "
        "reported) is the figure other processes disturb least: a descheduled step costs no CPU time",
    )
    args = parser.parse_args()
    llm = LLM(args.model, max_num_seqs=args.batch, kv_integrity=True)
    cpu_kernels.paged_decode_attention_kernel(wait=True)
    cpu_kernels.bf16_skinny_linear_kernel(wait=True)
    engine = llm.engine
    if args.threads:  # after the engine, which sets its own
        torch.set_num_threads(args.threads)
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
    check_in_loop_s: list[float] = []
    check = checking.check

    def timed_check(*check_args):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        result = check(*check_args)
        check_in_loop_s.append(time.perf_counter() - start)
        return result

    checking.check = timed_check  # type: ignore[method-assign]
    times: dict[bool, list[float]] = {True: [], False: []}
    ratios: list[float] = []
    cpu_times: dict[bool, list[float]] = {True: [], False: []}
    cpu_ratios: list[float] = []
    order_rng = random.Random(1)
    for _ in range(args.pairs):
        # A random order per pair: a fixed alternation has period 4 steps, which divides the page size, so
        # every step that allocates a new page (slower) fell on the same side and biased the ratio ~3%.
        pair: dict[bool, float] = {}
        cpu_pair: dict[bool, float] = {}
        for on in order_rng.sample((True, False), 2):
            worker.page_tag_check = checking if on else off
            builder.check_page_tags = on
            start, start_cpu = time.perf_counter(), time.thread_time()
            engine.step()
            pair[on] = time.perf_counter() - start
            cpu_pair[on] = time.thread_time() - start_cpu
            times[on].append(pair[on])
            cpu_times[on].append(cpu_pair[on])
        ratios.append(pair[True] / pair[False])
        cpu_ratios.append(cpu_pair[True] / cpu_pair[False])
    checking.check = check  # type: ignore[method-assign]
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
    in_loop_ms = statistics.median(check_in_loop_s) * 1e3
    paired, low, high = median_with_interval(ratios)
    cpu_paired, cpu_low, cpu_high = median_with_interval(cpu_ratios)
    on_cpu_ms, off_cpu_ms = (
        statistics.median(cpu_times[True]) * 1e3,
        statistics.median(cpu_times[False]) * 1e3,
    )
    tags_ms = max(0.0, statistics.median(build_s[True]) - statistics.median(build_s[False])) * 1e3
    work_ms = in_loop_ms + tags_ms
    compiled = cpu_kernels.check_page_tags_kernel() is not None
    print(
        f"batch {args.batch}, {step.page_table_width} pages per row ({len(step.page_table)} entries), "
        f"{'compiled' if compiled else 'NumPy'} check: step median on {on_ms:.3f} ms, off {off_ms:.3f} ms, "
        f"on/off {on_ms / off_ms:.4f}; median paired on/off {paired:.4f} (95% {low:.4f}-{high:.4f}); "
        f"main thread's CPU time a step on {on_cpu_ms:.3f} ms, off {off_cpu_ms:.3f} ms, on/off "
        f"{on_cpu_ms / off_cpu_ms:.4f}, median paired {cpu_paired:.4f} (95% {cpu_low:.4f}-{cpu_high:.4f}) "
        f"(torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}); integrity work per step {work_ms * 1e3:.1f} us = "
        f"{100 * work_ms / off_ms:.3f}% of a step (check in the step loop {in_loop_ms * 1e3:.1f} us, "
        f"back to back {check_ms * 1e3:.1f} us; expected tags in the builder {tags_ms * 1e3:.1f} us)"
    )


def median_with_interval(values: list[float]) -> tuple[float, float, float]:
    """The median and a bootstrap 95% interval for it."""
    rng = random.Random(2)
    boot = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(1000))
    return statistics.median(values), boot[25], boot[974]


if __name__ == "__main__":
    main()
