"""KV integrity under injected faults: run requests until N faults were injected, judge every answer.

    PYTHONPATH=src python scripts/kv_fault_campaign.py --engine hash --target-faults 10000
    PYTHONPATH=src python scripts/kv_fault_campaign.py --engine tiny --target-faults 300 --integrity off

`--engine hash`: the real Engine, scheduler, KV manager, step builder, worker check and recovery, over a
model that stores token ids in its KV slots and answers a hash of the context it reads through the page
table (tests/kv_fault_harness.py), so the fault-free answer is known exactly and many requests are cheap.
`--engine tiny`: a tiny random-weight Llama (tests/tiny_models.py) through `LLM`, judged against a
fault-free run of the same prompts on a second engine.

Reported: faults injected (by kind); row-steps read through an inconsistent page table (audited in Python
against the allocator, independently of the worker's tensor check) and how many the check caught; false
alarms; requests whose answer contains a wrong token; requests a fault hit and how many of them still
returned the whole correct answer (with `recompute`).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import torch  # noqa: E402
from kv_fault_harness import (  # noqa: E402
    HASH_VOCAB,
    Answer,
    Audit,
    drive,
    hash_engine,
    hash_greedy,
    inject_faults,
    judge,
    random_prompts,
)

from hearth.engine.config import EngineConfig  # noqa: E402
from hearth.engine.engine import Engine  # noqa: E402
from hearth.engine.factory import build_engine  # noqa: E402
from hearth.engine.worker import kv_layout_for  # noqa: E402
from hearth.kv.faults import KVFaultInjector, parse_faults  # noqa: E402
from hearth.model.config import ModelConfig  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engine", choices=("hash", "tiny"), default="hash")
    parser.add_argument(
        "--faults", default="early_free:0.004,table_swap:0.002", help="HEARTH_KV_FAULTS syntax"
    )
    parser.add_argument("--target-faults", type=int, default=10_000, help="stop after this many faults")
    parser.add_argument("--integrity", choices=("on", "off"), default="on")
    parser.add_argument("--action", choices=("recompute", "abort"), default="recompute")
    parser.add_argument("--round-requests", type=int, default=2000, help="requests per round")
    parser.add_argument("--max-rounds", type=int, default=1000)
    parser.add_argument("--page-size", type=int, default=4)
    parser.add_argument("--num-pages", type=int, default=400)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(3, 40), metavar=("MIN", "MAX"))
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--abort-probability", type=float, default=0.0005, help="per live request per step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write the result here")
    return parser.parse_args()


def make_engines(args: argparse.Namespace) -> tuple[Engine, Engine | None]:
    """(the engine under faults, a fault-free reference engine or None when answers are known exactly)."""
    integrity = args.integrity == "on"
    if args.engine == "hash":
        engine = hash_engine(
            num_pages=args.num_pages,
            page_size=args.page_size,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            kv_integrity=integrity,
            action=args.action,
        )
        return engine, None
    from tiny_models import make_tiny_model

    model = make_tiny_model(Path(tempfile.mkdtemp(prefix="kv-faults-")) / "tiny")
    model_config = ModelConfig.from_dir(str(model))
    sizing = EngineConfig(model=str(model), page_size=args.page_size)
    layout_bytes = kv_layout_for(sizing, model_config, torch.float32).bytes_per_page

    def config(with_integrity: bool) -> EngineConfig:
        return EngineConfig(
            model=str(model),
            dtype="float32",
            device="cpu",
            page_size=args.page_size,
            kv_cache_memory_gib=args.num_pages * layout_bytes / (1 << 30),
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            kv_integrity=with_integrity,
            kv_integrity_action=args.action,
        )

    engines = build_engine(config(integrity)), build_engine(config(False))
    for engine in engines:
        # KVPool storage is torch.empty: recycled memory may hold NaN bit patterns, and the attention
        # backends read whole pages (0 x NaN = NaN past a row's context); zeroed so the baseline is sound.
        engine.worker.kv_pool.storage.zero_()
    return engines


def main() -> None:
    args = parse_args()
    logging.getLogger("hearth.integrity").setLevel(logging.CRITICAL)  # thousands of expected mismatches

    engine, reference_engine = make_engines(args)
    injector = inject_faults(engine, parse_faults(args.faults), seed=args.seed)
    audit = Audit()
    audit.attach(engine)
    vocab = HASH_VOCAB if args.engine == "hash" else 500
    answers: dict[str, Answer] = {}
    reference: dict[str, list[int]] = {}
    started = time.perf_counter()
    rounds = 0
    while len(injector.injected) < args.target_faults and rounds < args.max_rounds:
        prompts = random_prompts(
            args.round_requests,
            args.seed * 100_003 + rounds,
            *args.prompt_len,
            vocab,
            shared_prefixes=16,
            prefix_len=2 * args.page_size + 1,
        )
        answers |= drive(engine, prompts, args.max_tokens, args.abort_probability, seed=args.seed + rounds)
        if reference_engine is None:
            reference |= {rid: hash_greedy(prompt, args.max_tokens) for rid, prompt in prompts.items()}
        else:
            reference |= {
                rid: a.token_ids for rid, a in drive(reference_engine, prompts, args.max_tokens).items()
            }
        rounds += 1
        print(
            f"round {rounds}: {len(answers)} requests, {len(injector.injected)} faults, "
            f"{time.perf_counter() - started:.0f} s",
            file=sys.stderr,
        )
    print(
        json.dumps(
            summarize(args, engine, injector, audit, answers, reference, time.perf_counter() - started),
            indent=2,
        )
    )


def summarize(
    args: argparse.Namespace,
    engine: Engine,
    injector: KVFaultInjector,
    audit: Audit,
    answers: dict[str, Answer],
    reference: dict[str, list[int]],
    elapsed_s: float,
) -> dict[str, Any]:
    verdict = judge(answers, reference)
    wrong_tokens = 0
    for request_id in verdict.wrong_request_ids:
        got, want = answers[request_id].token_ids, reference[request_id]
        wrong_tokens += sum(1 for i, token in enumerate(got) if i >= len(want) or token != want[i])
    hit = {request_id for _, request_id in audit.inconsistent}  # a fault reached a step's reads
    hit_ok = sum(
        1
        for rid in hit
        if answers[rid].finish_reason not in ("error",) and answers[rid].token_ids == reference[rid]
    )
    hit_aborted = sum(
        1 for rid in hit if answers[rid].finish_reason == "abort"
    )  # by the driver, not the check
    victims = {rid for fault in injector.injected for rid in fault.request_ids}
    result = {
        "engine": args.engine,
        "faults_spec": args.faults,
        "integrity": args.integrity,
        "action": args.action,
        "elapsed_s": round(elapsed_s, 1),
        "requests": verdict.num_requests,
        "faults_injected": len(injector.injected),
        "faults_by_kind": injector.counts(),
        "victim_requests": len(victims),
        "inconsistent_row_steps": len(audit.inconsistent),
        "detected_row_steps": len(audit.detected),
        "missed_row_steps": len(audit.inconsistent - audit.detected),
        "false_alarm_row_steps": len(audit.detected - audit.inconsistent),
        "detected_pct": round(
            100 * len(audit.inconsistent & audit.detected) / max(1, len(audit.inconsistent)), 3
        ),
        "requests_wrong": verdict.num_wrong,
        "wrong_tokens_returned": wrong_tokens,
        "requests_correct": verdict.num_correct,
        "requests_error": verdict.num_error,
        "requests_aborted_by_driver": verdict.num_aborted,
        "requests_hit": len(hit),
        "requests_hit_still_correct": hit_ok,
        "requests_hit_aborted_by_driver": hit_aborted,
        "hit_success_pct": round(100 * hit_ok / max(1, len(hit) - hit_aborted), 3),
        "recomputes": engine.integrity.num_recomputed,
        "stale_page_releases_skipped": engine.kv.num_stale_pages,
        "pages_free_at_end": engine.kv.num_available_pages,
        "pages_total": engine.kv.num_pages,
    }
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
