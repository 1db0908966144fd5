"""What a verify row costs the target next to a one-token decode step, in one process, alternating.

Hand-built steps on the worker of an engine (no scheduler): one request whose context (`--context` tokens)
sits in consecutive pages; a decode step (1 query token) and a verify step (1 + K query tokens, the row
speculative decoding sends) are timed alternately, whole `Worker.execute` (forward + greedy sampling),
median over `--pairs`, CPU time of the
(single-threaded) process and wall. `--compare` also times the verify step through the prefill attention path (the
multi-token-row kernel off) in the same loop.

    PYTHONPATH=src python scripts/time_verify_row.py --model models/demo --pairs 200 --compare
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=REPO_ROOT / "models" / "demo")
    parser.add_argument("--context", type=int, default=256, help="tokens already in the KV cache")
    parser.add_argument("--num-drafts", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=200)
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--compare", action="store_true", help="also time the verify row on the prefill path")
    args = parser.parse_args(argv)

    import torch

    from hearth import LLM, SamplingParams
    from hearth.engine.forward_batch import ForwardBatch, StepSamplingRow
    from hearth.ops import cpu_kernels

    llm = LLM(str(args.model), num_threads=args.num_threads, kv_cache_memory_gib=0.25)
    cpu_kernels.paged_decode_attention_kernel(wait=True)
    worker = llm.engine.worker
    page_size = llm.engine.config.page_size
    vocab = llm.engine.model_config.vocab_size
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(0, vocab, (args.context,), generator=generator).tolist()
    num_pages = -(-(args.context + args.num_drafts + 1) // page_size)
    pages = list(range(1, num_pages + 1))
    params = SamplingParams(temperature=0.0, max_tokens=64)

    def step(start: int, tokens: list[int], num_decode_rows: int) -> ForwardBatch:
        end = start + len(tokens)
        return ForwardBatch(
            token_ids=tokens,
            positions=list(range(start, end)),
            query_start_loc=[0, len(tokens)],
            seq_lens=[end],
            num_decode_rows=num_decode_rows,
            page_table=pages,
            page_table_width=len(pages),
            slot_mapping=[pages[p // page_size] * page_size + p % page_size for p in range(start, end)],
            logits_indices=list(range(len(tokens))),
            sampling=[StepSamplingRow("r", params.sampler_params(), 0, draft_token_ids=tokens[1:])],
        )

    worker.execute(step(0, context, 0))  # the context's KV
    last = args.context
    decode = step(last, [1], 1)
    verify = step(last, [1] + context[: args.num_drafts], 0)
    backend = worker.attention
    configs: dict[str, tuple[ForwardBatch, bool]] = {"decode": (decode, True), "verify": (verify, True)}
    if args.compare:
        configs["verify_prefill_path"] = (verify, False)
    times: dict[str, list[float]] = {
        name: [] for name in configs
    }  # CPU seconds (one thread: a quiet wall clock)
    walls: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(5):
        for s, _kernel in configs.values():
            worker.execute(s)
    for _ in range(args.pairs):
        for name, (s, multi_row_kernel) in configs.items():
            backend.verify_rows_kernel = multi_row_kernel
            started, cpu_started = time.perf_counter(), time.process_time()
            worker.execute(s)
            times[name].append(time.process_time() - cpu_started)
            walls[name].append(time.perf_counter() - started)
    backend.verify_rows_kernel = True
    base = statistics.median(times["decode"])
    wall_base = statistics.median(walls["decode"])
    print(f"load average {os.getloadavg()[0]:.2f}; context {args.context}, {args.num_drafts} drafts; medians")
    for name, samples in times.items():
        median, wall = statistics.median(samples), statistics.median(walls[name])
        print(
            f"{name:>22}: CPU {1000 * median:.3f} ms ({median / base:.2f}x decode); "
            f"wall {1000 * wall:.3f} ms ({wall / wall_base:.2f}x)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
