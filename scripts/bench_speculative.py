"""Speculative decoding on tool-call prompts: output tok/s with each method against none, in one run.

Held-out agent prompts of the demo model's data (each ends right before an assistant turn that must be a
tool call). Configurations are measured interleaved (round robin, several rounds) so a noisy machine
hits them alike; the report gives ratios to the no-speculation baseline of the same round.

    python scripts/bench_speculative.py --batch-size 1 --methods ngram draft --rounds 3
    python scripts/bench_speculative.py --batch-size 64 --methods ngram draft --max-tokens 64
    python scripts/bench_speculative.py --batch-size 1 --methods ngram eagle3 --fixed-k  # accepted length at K
    python scripts/bench_speculative.py --batch-size 1 --methods draft@4 draft@8  # K per configuration
    python scripts/bench_speculative.py --model M --speculative-model D --random-prompts 200  # any model
    python scripts/bench_speculative.py --trace agentic --num-prompts 4 --methods ngram suffix@8  # multi-turn
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "scripts"))


def tool_call_prompts(model_dir: Path, num_prompts: int, seed: int) -> list[list[int]]:
    import eval_demo_model

    from hearth.model.tokenizer import Tokenizer
    from hearth.server.chat_template import ChatTemplate

    tokenizer = Tokenizer.from_dir(model_dir)
    template = ChatTemplate.from_dir(model_dir)
    return [
        tokenizer.encode(template.render(p["messages"], tools=p["tools"]), add_special_tokens=False)
        for p in eval_demo_model.tool_prompts(num_prompts, seed)
    ]


def run_batch(
    llm: Any,
    prompts: list[list[int]],
    max_tokens: int,
    ignore_eos: bool,
    answers: list[list[int]] | None = None,
) -> dict[str, float]:
    """All prompts at once; output tokens, wall time, and decode time (after each request's first token).
    `answers`, when given, gets each prompt's output token ids appended (in prompt order)."""
    from hearth import SamplingParams
    from hearth.engine.messages import EngineRequest

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    first_at: dict[str, float] = {}
    counts: dict[str, int] = {}
    ids = [f"b{time.perf_counter_ns()}-{i}" for i in range(len(prompts))]
    started = time.perf_counter()
    cpu_started = time.process_time()
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(EngineRequest(request_id, prompt, params))
    done = 0
    first_cpu: float | None = None  # CPU clock at the batch's first token: prefill before, decode after
    collected: dict[str, list[int]] = {}
    while done < len(prompts):
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.new_token_ids:
                if first_cpu is None:
                    first_cpu = time.process_time()
                first_at.setdefault(out.request_id, now)
                counts[out.request_id] = counts.get(out.request_id, 0) + len(out.new_token_ids)
                if answers is not None:
                    collected.setdefault(out.request_id, []).extend(out.new_token_ids)
            done += out.finished
    elapsed = time.perf_counter() - started
    cpu_s = time.process_time() - cpu_started
    if answers is not None:
        answers.extend(collected.get(request_id, []) for request_id in ids)
    output_tokens = sum(counts.values())
    decode_tokens = output_tokens - len(prompts)
    decode_s = elapsed - (min(first_at.values()) - started) if first_at else elapsed
    return {
        "output_tokens": output_tokens,
        "elapsed_s": elapsed,
        "decode_tokens": decode_tokens,
        "decode_s": decode_s,
        "cpu_s": cpu_s,
        "decode_cpu_s": time.process_time() - first_cpu if first_cpu is not None else cpu_s,
    }


def measure(
    llm: Any, prompts: list[list[int]], batch_size: int, max_tokens: int, ignore_eos: bool
) -> dict[str, float]:
    totals = {
        "output_tokens": 0,
        "elapsed_s": 0.0,
        "decode_tokens": 0,
        "decode_s": 0.0,
        "cpu_s": 0.0,
        "decode_cpu_s": 0.0,
    }
    for start in range(0, len(prompts), batch_size):
        part = run_batch(llm, prompts[start : start + batch_size], max_tokens, ignore_eos)
        for key in totals:
            totals[key] += part[key]
    return totals


def measure_trace(
    llm: Any, kind: str, num_conversations: int, batch_size: int, max_tokens: int, answers: list[list[int]]
) -> dict[str, float]:
    """The multi-turn trace (`spec_traces`), `batch_size` conversations in lockstep: each turn of the group
    is one batch, rendered from the history including the group's previous answers."""
    import spec_traces

    from hearth.server.chat_template import ChatTemplate

    template = ChatTemplate.from_dir(llm.engine.config.model)
    tokenizer = llm.tokenizer
    totals: dict[str, float] = {}
    group_list = spec_traces.conversations(kind, num_conversations)
    for start in range(0, len(group_list), batch_size):
        group = group_list[start : start + batch_size]
        pending = [(conv, conv.start()) for conv in group]
        while pending:
            prompts = [
                tokenizer.encode(
                    template.render(messages, tools=spec_traces.TOOLS if kind == "agentic" else None),
                    add_special_tokens=False,
                )
                for _, messages in pending
            ]
            turn_answers: list[list[int]] = []
            part = run_batch(llm, prompts, max_tokens, False, turn_answers)
            for key, value in part.items():
                totals[key] = totals.get(key, 0.0) + value
            answers.extend(turn_answers)
            nexts = []
            for (conv, _), tokens in zip(pending, turn_answers, strict=True):
                messages = conv.answered(tokenizer.decode(tokens, skip_special_tokens=True))
                if messages is not None:
                    nexts.append((conv, messages))
            pending = nexts
    return totals


def _timed(propose: Any, total: list[float]) -> Any:
    """`propose`, adding its wall seconds and calls to `total` (where a speculative step's time goes)."""

    def timed(batch: Any) -> Any:
        started = time.perf_counter()
        out = propose(batch)
        total[0] += time.perf_counter() - started
        total[1] += 1
        return out

    return timed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=REPO_ROOT / "models" / "demo")
    parser.add_argument("--speculative-model", type=Path, default=REPO_ROOT / "models" / "demo-draft")
    parser.add_argument(
        "--eagle3-model", type=Path, default=REPO_ROOT / "models" / "demo-eagle3", help="the head for eagle3"
    )
    parser.add_argument("--methods", nargs="+", default=["ngram", "draft"])
    parser.add_argument(
        "--fixed-k", action="store_true", help="no adaptive K or payoff switch: K drafts on every step"
    )
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument(
        "--speculative-max-batch-size", type=int, default=None, help="default: the engine's (8 on CPU)"
    )
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=4242, help="held-out prompts (not the training seeds)")
    parser.add_argument(
        "--random-prompts", type=int, default=0, help="random token prompts of this length instead"
    )
    parser.add_argument("--num-threads", type=int, default=1, help="1: CPU time is then a fair clock")
    parser.add_argument(
        "--trace",
        choices=["tool-calls", "agentic", "chat"],
        default="tool-calls",
        help="tool-calls: single-turn held-out demo prompts; agentic / chat: multi-turn closed loops "
        "(scripts/spec_traces.py) of --num-prompts conversations",
    )
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--output-json", type=Path, default=None)
    args = parser.parse_args(argv)

    from hearth import LLM

    if args.random_prompts:
        import random

        from hearth.model.config import ModelConfig

        vocab = ModelConfig.from_dir(args.model).vocab_size
        rng = random.Random(args.seed)
        prompts = [
            [rng.randrange(vocab) for _ in range(args.random_prompts)] for _ in range(args.num_prompts)
        ]
        ignore_eos = True
    elif args.trace == "tool-calls":
        prompts = tool_call_prompts(args.model, args.num_prompts, args.seed)
        ignore_eos = False
    else:
        prompts = []
        ignore_eos = False
    common = dict(num_threads=args.num_threads, kv_cache_memory_gib=0.5, dtype=args.dtype)
    configs: dict[str, dict[str, Any]] = {"none": {}}
    for name in args.methods:
        # "draft@8": the method with its own K (several K of one method compared in one run).
        method, _, k = name.partition("@")
        configs[name] = dict(
            speculative_method=method,
            speculative_model=(
                None
                if method in ("ngram", "suffix")
                else str(args.eagle3_model if method == "eagle3" else args.speculative_model)
            ),
            num_speculative_tokens=int(k) if k else args.num_speculative_tokens,
            speculative_max_batch_size=args.speculative_max_batch_size,
        )
    engines = {name: LLM(str(args.model), **common, **options) for name, options in configs.items()}
    propose_time: dict[str, list[float]] = {}  # per engine: [seconds in propose, calls]
    for name, llm in engines.items():
        speculator = llm.engine.speculator
        if speculator is None:
            continue
        if args.fixed_k:
            speculator.adaptive = False
        propose_time[name] = [0.0, 0]
        speculator.proposer.propose = _timed(speculator.proposer.propose, propose_time[name])
    from hearth.ops import cpu_kernels

    cpu_kernels.paged_decode_attention_kernel(wait=True)
    for llm in engines.values():  # warm-up: kernels, allocator, first-call paths
        if prompts:
            measure(llm, prompts[:2], args.batch_size, 8, ignore_eos)
        else:
            measure_trace(llm, args.trace, 1, 1, 8, [])
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in configs}
    answers: dict[str, list[list[int]]] = {}
    load_before = os.getloadavg()
    for _ in range(args.rounds):
        for name, llm in engines.items():
            llm.engine.kv.reset_prefix_cache()
            proposer = llm.engine.speculator.proposer if llm.engine.speculator is not None else None
            if hasattr(proposer, "forget"):
                proposer.forget()  # every round starts with no earlier answers learned (the same trace again)
            if prompts:
                rounds[name].append(measure(llm, prompts, args.batch_size, args.max_tokens, ignore_eos))
            else:
                answers[name] = []
                rounds[name].append(
                    measure_trace(
                        llm, args.trace, args.num_prompts, args.batch_size, args.max_tokens, answers[name]
                    )
                )
    report: dict[str, Any] = {
        "trace": args.trace,
        "model": str(args.model),
        "batch_size": args.batch_size,
        "num_prompts": len(prompts) or args.num_prompts,  # traces: conversations
        "load_average_1m_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "fixed_k": args.fixed_k,
        "configs": {},
    }
    print("load average (1 min) before, after:", report["load_average_1m_before_after"])
    base = rounds["none"]
    for name, results in rounds.items():
        ratios = [
            r["output_tokens"] / r["elapsed_s"] / (b["output_tokens"] / b["elapsed_s"])
            for r, b in zip(results, base)
        ]
        decode_ratios = [
            r["decode_tokens"] / r["decode_s"] / (b["decode_tokens"] / b["decode_s"])
            for r, b in zip(results, base)
        ]
        # CPU seconds of this (single-threaded) process: what a quiet machine's wall clock would show.
        cpu_ratios = [
            b["cpu_s"] / b["output_tokens"] / (r["cpu_s"] / r["output_tokens"]) for r, b in zip(results, base)
        ]
        # The decode phase alone (after each batch's first token), in CPU seconds: what speculation changes.
        cpu_decode_ratios = [
            b["decode_cpu_s"] / b["decode_tokens"] / (r["decode_cpu_s"] / r["decode_tokens"])
            for r, b in zip(results, base)
        ]
        entry = {
            "output_tok_s": [round(r["output_tokens"] / r["elapsed_s"], 1) for r in results],
            "output_tok_per_cpu_s": [round(r["output_tokens"] / r["cpu_s"], 1) for r in results],
            "cpu_speedup_median": round(statistics.median(cpu_ratios), 3),
            "output_speedup_median": round(statistics.median(ratios), 3),
            "decode_speedup_median": round(statistics.median(decode_ratios), 3),
            "cpu_decode_speedup_median": round(statistics.median(cpu_decode_ratios), 3),
            "prefill_share_of_cpu": round(
                1 - sum(r["decode_cpu_s"] for r in results) / sum(r["cpu_s"] for r in results), 3
            ),
            "output_tokens": results[-1]["output_tokens"],
        }
        speculator = engines[name].engine.speculator
        if speculator is not None:
            seconds, calls = propose_time[name]
            entry["propose_ms_per_call"] = round(1000 * seconds / max(1, calls), 2)
            entry["acceptance_rate"] = round(speculator.stats.acceptance_rate, 3)
            entry["mean_accepted_length"] = round(speculator.stats.mean_accepted_length, 3)
        report["configs"][name] = entry
        print(name, json.dumps(entry))
    same = all(r["output_tokens"] == base[-1]["output_tokens"] for r in (v[-1] for v in rounds.values()))
    report["same_output_token_counts"] = same
    if answers:
        report["same_answers"] = all(tokens == answers["none"] for tokens in answers.values())
        print("identical answers across configurations:", report["same_answers"])
    if args.output_json:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
