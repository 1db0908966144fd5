"""KV integrity under injected faults: run requests until N faults were injected, judge every answer.

    PYTHONPATH=src python scripts/kv_fault_campaign.py --engine hash --target-faults 10000
    # issue 14's goal in one run (sparse faults, ~1.27M short requests, ~20 min; docs/benchmarks.md):
    PYTHONPATH=src nice -n 10 python scripts/kv_fault_campaign.py --engine hash --target-faults 10000 \
        --faults early_free:0.0028,table_swap:0.0014 --round-requests 25000 --max-rounds 1000 \
        --prompt-len 2 8 --max-tokens 2 --max-num-seqs 256 --num-pages 4000 --max-num-batched-tokens 4096 \
        --shared-prefixes 0
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
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
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
from hearth.engine.messages import EngineRequest  # noqa: E402
from hearth.engine.sampling_params import SamplingParams  # noqa: E402
from hearth.engine.worker import kv_layout_for  # noqa: E402
from hearth.kv.faults import KVFaultInjector, parse_faults  # noqa: E402
from hearth.model.config import ModelConfig  # noqa: E402
from hearth.ops import cpu_kernels  # noqa: E402


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
    parser.add_argument(
        "--shared-prefixes",
        type=int,
        default=16,
        help="prompts start with one of this many common prefixes (prefix-cache reuse; a fault on a shared "
        "page hits every request holding it)",
    )
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


@dataclass
class Tally:
    """Totals over the rounds judged so far (each round's answers are judged and dropped when it ends, so a
    run of millions of requests holds one round in memory)."""

    requests: int = 0
    correct: int = 0
    error: int = 0
    aborted: int = 0
    wrong: int = 0
    wrong_tokens: int = 0
    hit: int = 0  # requests that a fault reached (a step read through an inconsistent page table)
    hit_ok: int = 0  # of those: the whole correct answer
    hit_aborted: int = 0  # of those: aborted by the driver, not the check
    wrong_examples: list[str] = field(default_factory=list)

    def add(self, answers: dict[str, Answer], reference: dict[str, list[int]], hit_ids: set[str]) -> None:
        verdict = judge(answers, reference)
        self.requests += verdict.num_requests
        self.correct += verdict.num_correct
        self.error += verdict.num_error
        self.aborted += verdict.num_aborted
        self.wrong += verdict.num_wrong
        self.wrong_examples += verdict.wrong_request_ids[: max(0, 5 - len(self.wrong_examples))]
        for request_id in verdict.wrong_request_ids:
            got, want = answers[request_id].token_ids, reference[request_id]
            self.wrong_tokens += sum(1 for i, token in enumerate(got) if i >= len(want) or token != want[i])
        for request_id in [rid for rid in answers if rid in hit_ids]:
            answer = answers[request_id]
            self.hit += 1
            self.hit_ok += answer.finish_reason != "error" and answer.token_ids == reference[request_id]
            self.hit_aborted += answer.finish_reason == "abort"


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)  # small tensor ops: thread hand-offs would cost more than they save
    logging.getLogger("hearth.integrity").setLevel(logging.CRITICAL)  # thousands of expected mismatches
    # The check a CPU server runs once its kernels are loaded (the compiled one), not the NumPy stand-in.
    cpu_kernels.paged_decode_attention_kernel(wait=True)

    engine, reference_engine = make_engines(args)
    injector = inject_faults(engine, parse_faults(args.faults), seed=args.seed)
    audit = Audit()
    audit.attach(engine)
    vocab = HASH_VOCAB if args.engine == "hash" else 500
    tally = Tally()
    started = time.perf_counter()
    if reference_engine is None:
        stream(engine, args, injector, audit, tally, started)
    else:
        run_rounds(engine, reference_engine, args, injector, audit, tally, started, vocab)
    print(
        json.dumps(summarize(args, engine, injector, audit, tally, time.perf_counter() - started), indent=2)
    )


def progress(
    args: argparse.Namespace,
    engine: Engine,
    injector: KVFaultInjector,
    audit: Audit,
    tally: Tally,
    started: float,
) -> None:
    result = summarize(args, engine, injector, audit, tally, time.perf_counter() - started)
    print(
        f"{tally.requests} requests, {len(injector.injected)} faults, {tally.hit} hit "
        f"({result['hit_success_pct']}% still correct), {tally.wrong} wrong, "
        f"{result['detected_pct']}% of bad reads detected, {result['elapsed_s']:.0f} s",
        file=sys.stderr,
        flush=True,
    )


def stream(
    engine: Engine,
    args: argparse.Namespace,
    injector: KVFaultInjector,
    audit: Audit,
    tally: Tally,
    started: float,
) -> None:
    """The hash engine: one continuous stream of requests (the engine's seats stay full, as in a server;
    draining a batch would leave its last few requests to take every fault of the allocations around
    them), each judged against its closed-form answer as it finishes."""
    rng = random.Random(args.seed)
    window = 4 * engine.config.max_num_seqs
    prompts: dict[str, list[int]] = {}
    answers: dict[str, Answer] = {}
    live_prompts: dict[str, list[int]] = {}
    chunks = 0
    while True:
        adding = len(injector.injected) < args.target_faults and chunks <= args.max_rounds
        while adding and len(answers) < window:
            if not prompts:
                if chunks == args.max_rounds:
                    break
                prompts = random_prompts(
                    args.round_requests,
                    args.seed * 100_003 + chunks,
                    *args.prompt_len,
                    HASH_VOCAB,
                    shared_prefixes=args.shared_prefixes,
                    prefix_len=2 * args.page_size + 1,
                )
                chunks += 1
            request_id, prompt = prompts.popitem()
            params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
            engine.add_request(EngineRequest(request_id, prompt, params))
            answers[request_id] = Answer([])
            live_prompts[request_id] = prompt
        if not answers:
            return
        outputs = engine.step()
        if args.abort_probability:
            doomed = [rid for rid in answers if rng.random() < args.abort_probability]
            outputs += engine.abort(doomed)
        for output in outputs:
            answer = answers[output.request_id]
            answer.token_ids += output.new_token_ids
            if output.finish_reason is None:
                continue
            answer.finish_reason, answer.error = output.finish_reason, output.error
            answer.error_code = output.error_code
            del answers[output.request_id]
            reference = hash_greedy(live_prompts.pop(output.request_id), args.max_tokens)
            tally.add(
                {output.request_id: answer}, {output.request_id: reference}, audit.inconsistent_requests
            )
            if tally.requests % args.round_requests == 0:
                progress(args, engine, injector, audit, tally, started)


def run_rounds(
    engine: Engine,
    reference_engine: Engine,
    args: argparse.Namespace,
    injector: KVFaultInjector,
    audit: Audit,
    tally: Tally,
    started: float,
    vocab: int,
) -> None:
    """A model engine: rounds of requests, each judged against a fault-free run of the same prompts."""
    rounds = 0
    while len(injector.injected) < args.target_faults and rounds < args.max_rounds:
        prompts = random_prompts(
            args.round_requests,
            args.seed * 100_003 + rounds,
            *args.prompt_len,
            vocab,
            shared_prefixes=args.shared_prefixes,
            prefix_len=2 * args.page_size + 1,
        )
        answers = drive(engine, prompts, args.max_tokens, args.abort_probability, seed=args.seed + rounds)
        reference = {rid: a.token_ids for rid, a in drive(reference_engine, prompts, args.max_tokens).items()}
        # Every request of the round has finished, so its audit entries are all in.
        tally.add(answers, reference, audit.inconsistent_requests)
        rounds += 1
        progress(args, engine, injector, audit, tally, started)


def summarize(
    args: argparse.Namespace,
    engine: Engine,
    injector: KVFaultInjector,
    audit: Audit,
    tally: Tally,
    elapsed_s: float,
) -> dict[str, Any]:
    """The totals so far (written to --json after every round, so a run cut short still leaves its numbers)."""
    victims = {rid for fault in injector.injected for rid in fault.request_ids}
    result = {
        "engine": args.engine,
        "check": "compiled" if cpu_kernels.check_page_tags_kernel() is not None else "numpy",
        "faults_spec": args.faults,
        "integrity": args.integrity,
        "action": args.action,
        "command": " ".join(sys.argv),
        "elapsed_s": round(elapsed_s, 1),
        "requests": tally.requests,
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
        "requests_wrong": tally.wrong,
        "wrong_request_examples": tally.wrong_examples,
        "wrong_tokens_returned": tally.wrong_tokens,
        "requests_correct": tally.correct,
        "requests_error": tally.error,
        "requests_aborted_by_driver": tally.aborted,
        "requests_hit": tally.hit,
        "requests_hit_still_correct": tally.hit_ok,
        "requests_hit_aborted_by_driver": tally.hit_aborted,  # by the driver, not the check
        "hit_success_pct": round(100 * tally.hit_ok / max(1, tally.hit - tally.hit_aborted), 3),
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
