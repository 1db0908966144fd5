"""Driving an engine under injected KV faults, and judging every answer (tests and scripts/kv_fault_campaign.py).

Two engines run the same scheduler, KV manager, step builder, worker check and recovery path:
- `hash_engine`: the real `Engine` and `Worker.execute` over `HashWorker`, whose "model" stores each token id in
  its KV slot and answers a hash of the whole context it reads through the page table. Reading a wrong page
  changes the answer, and the fault-free answer is known in closed form (`hash_greedy`), so millions of
  tokens can be judged in minutes.
- any `LLM(...).engine` (a tiny transformer), judged against a fault-free run of the same engine.

`drive` runs requests to the end (aborting some on the way) while `Audit` records, independently of the
worker's tensor check, which rows were read through an inconsistent page table (an entry whose page's
current tag, in the allocator, is not the one the request recorded).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from hearth.contracts.step import StepInput
from hearth.engine.config import EngineConfig
from hearth.engine.engine import Engine
from hearth.engine.forward_batch import ForwardBatch
from hearth.engine.messages import EngineRequest
from hearth.engine.persistent_batch import PersistentBatch
from hearth.engine.sampler import Sampler
from hearth.engine.sampling_params import SamplingParams
from hearth.engine.scheduler import ScheduledRequest, Scheduler
from hearth.engine.worker import StepOutput, Worker
from hearth.kv.faults import KVFaultInjector
from hearth.kv.integrity import make_page_tag_check
from hearth.kv.manager import KVCacheManager
from hearth.kv.pool import KVLayout, KVPool

HASH_VOCAB = 1000
# The "model": a position-weighted sum of the context mod a prime, so a whole batch is hashed in a few
# tensor ops (the campaign runs hundreds of thousands of requests). Any changed, missing or reordered
# context token changes the sum, and with it (with probability 1 - 1/HASH_VOCAB) the next token.
_MULTIPLIER, _MODULUS, _SEED = 1_000_003, (1 << 31) - 1, 7
_powers: list[int] = [1]


def _power(position: int) -> int:
    while len(_powers) <= position:
        _powers.append(_powers[-1] * _MULTIPLIER % _MODULUS)
    return _powers[position]


def hash_next(context: Iterable[int]) -> int:
    value = _SEED
    for position, token in enumerate(context):
        value = (value + (token + 1) * _power(position)) % _MODULUS
    return value % HASH_VOCAB


def hash_greedy(prompt: list[int], max_tokens: int) -> list[int]:
    value = _SEED
    for position, token in enumerate(prompt):
        value = (value + (token + 1) * _power(position)) % _MODULUS
    output: list[int] = []
    for position in range(len(prompt), len(prompt) + max_tokens):
        token = value % HASH_VOCAB
        output.append(token)
        value = (value + (token + 1) * _power(position)) % _MODULUS
    return output


class HashWorker(Worker):
    """`Worker.execute` (tag check, cutting failing rows) over a model that reads the KV cache literally:
    slot = token id; next token = `hash_next` of the context read through the row's page table. Greedy
    only: the step's answer is that token (no logits, no sampler: what is under test is which pages a row
    reads, not sampling)."""

    def __init__(self, num_pages: int, page_size: int, kv_integrity: bool) -> None:
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        layout = KVLayout(1, 1, 1, page_size, torch.float32)
        self.kv_pool = KVPool(layout, num_pages)
        self.page_tag_check = make_page_tag_check(kv_integrity)
        self.batch = PersistentBatch(page_size, check_page_tags=kv_integrity)
        self.is_sampling_rank = True
        self.sampler = Sampler(HASH_VOCAB, set())
        self._generators = {}
        self._last_sampled = []
        self.model = None  # type: ignore[assignment]
        self.kv_worker = None  # KV stays in this pool
        self._slots = self.kv_pool.storage[0, 0, :, 0, 0]
        self._powers = torch.zeros(0, dtype=torch.long)

    def _run(self, step: ForwardBatch) -> StepOutput:
        if any(row.draft_token_ids or not row.params.greedy for row in step.sampling):
            raise ValueError("HashWorker answers greedy rows without drafts only")
        slots = self._slots
        slots[torch.tensor(step.slot_mapping, dtype=torch.long)] = torch.tensor(
            step.token_ids, dtype=torch.float32
        )
        if not step.logits_indices:
            return StepOutput([])
        page_size, width = self.kv_pool.page_size, step.page_table_width
        index = torch.tensor(step.logits_indices, dtype=torch.long)
        rows = torch.searchsorted(torch.tensor(step.query_start_loc), index, right=True) - 1
        last = torch.tensor(step.positions, dtype=torch.long)[index]  # the context is positions 0..last
        length = int(last.max()) + 1
        if self._powers.numel() < length:
            _power(length)
            self._powers = torch.tensor(_powers, dtype=torch.long)
        position = torch.arange(length)
        table = torch.tensor(step.page_table, dtype=torch.long).view(-1, width)[rows]  # [n, width]
        read = table[:, position // page_size] * page_size + position % page_size  # [n, length] slots
        tokens = slots[read].long()
        terms = (tokens + 1) * self._powers[:length] * (position <= last[:, None])
        answers = (terms.sum(1) + _SEED) % _MODULUS % HASH_VOCAB
        return StepOutput([[token] for token in answers.tolist()])


def hash_engine(
    num_pages: int,
    page_size: int = 4,
    max_num_seqs: int = 32,
    max_num_batched_tokens: int = 256,
    kv_integrity: bool = True,
    action: str = "recompute",
    max_model_len: int = 4096,
    async_scheduling: bool = False,
) -> Engine:
    config = EngineConfig(
        model="hash",
        async_scheduling=async_scheduling,
        page_size=page_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        kv_integrity=kv_integrity,
        kv_integrity_action=action,
    )
    kv = KVCacheManager(num_pages, page_size, True)
    return Engine(
        config=config,
        model_config=SimpleNamespace(vocab_size=HASH_VOCAB),  # type: ignore[arg-type]
        tokenizer=None,  # type: ignore[arg-type]
        kv=kv,
        scheduler=Scheduler(kv, max_num_batched_tokens, max_num_seqs),
        worker=HashWorker(num_pages, page_size, kv_integrity),
        structured=None,  # type: ignore[arg-type]
        eos_token_ids=set(),
        kv_layout_tag="hash",
        max_model_len=max_model_len,
        num_kv_tokens=num_pages * page_size,
    )


def inject_faults(engine: Engine, probabilities: dict[str, float], seed: int) -> KVFaultInjector:
    scheduler = engine.scheduler
    injector = KVFaultInjector(probabilities, seed=seed, victims=lambda: scheduler.running)
    engine.kv.faults = injector
    return injector


@dataclass
class Audit:
    """Wraps an engine's step builder and worker: per step, the rows read through an inconsistent page table
    (computed from the allocator, in Python) and the rows the worker's check reported."""

    inconsistent: set[tuple[int, str]] = field(default_factory=set)  # (step, request id)
    inconsistent_requests: set[str] = field(default_factory=set)  # every request id in `inconsistent`
    detected: set[tuple[int, str]] = field(default_factory=set)
    steps: int = 0

    def attach(self, engine: Engine) -> None:
        build, execute = engine.step_inputs.build, engine.worker.execute
        generations = engine.kv.allocator.generations
        page_size = engine.kv.page_size
        rows: list[str] = []

        def audited_build(scheduled: list[ScheduledRequest], *args: Any) -> StepInput:
            self.steps += 1
            rows.clear()
            for item in scheduled:
                request = item.request
                rows.append(request.request_id)
                end = request.num_computed_tokens + item.num_new_tokens
                num_pages = -(-end // page_size)
                pairs = zip(request.page_ids[:num_pages], request.page_generations[:num_pages], strict=True)
                if any(generations[page] != tag for page, tag in pairs):
                    self.inconsistent.add((self.steps, request.request_id))
                    self.inconsistent_requests.add(request.request_id)
            return build(scheduled, *args)

        def audited_execute(step: StepInput) -> StepOutput:
            output = execute(step)
            for mismatch in output.kv_mismatches:
                self.detected.add((self.steps, rows[mismatch.row]))
            return output

        engine.step_inputs.build = audited_build  # type: ignore[method-assign]
        engine.worker.execute = audited_execute  # type: ignore[method-assign]


@dataclass
class Answer:
    token_ids: list[int]
    finish_reason: str | None = None
    error: str | None = None
    error_code: str | None = None


def drive(
    engine: Engine,
    prompts: dict[str, list[int]],
    max_tokens: int | Callable[[str], int],
    abort_probability: float = 0.0,
    seed: int = 0,
    window: int = 0,
) -> dict[str, Answer]:
    """Greedy answers of every prompt; each running request is aborted with `abort_probability` per step.

    Requests are added `window` at a time (default: 4x the engine's seats) so the queue stays short.
    """
    rng = random.Random(seed)
    window = window or 4 * engine.config.max_num_seqs
    answers: dict[str, Answer] = {}
    pending = list(prompts.items())
    live: set[str] = set()
    idle_steps = 0
    while pending or live:
        while pending and len(live) < window:
            request_id, prompt = pending.pop()
            budget = max_tokens(request_id) if callable(max_tokens) else max_tokens
            params = SamplingParams(temperature=0.0, max_tokens=budget, ignore_eos=True)
            engine.add_request(EngineRequest(request_id, prompt, params))
            answers[request_id] = Answer([])
            live.add(request_id)
        outputs = engine.step()
        idle_steps = 0 if outputs else idle_steps + 1
        if idle_steps > 1000:
            kv = engine.kv
            raise RuntimeError(
                f"no progress in 1000 steps: {len(live)} live, {kv.num_available_pages}/{kv.num_pages} pages free"
            )
        if abort_probability:
            doomed = [rid for rid in live if rng.random() < abort_probability]
            outputs += engine.abort(doomed)
        for output in outputs:
            answer = answers[output.request_id]
            answer.token_ids += output.new_token_ids
            if output.finish_reason is not None:
                answer.finish_reason = output.finish_reason
                answer.error = output.error
                answer.error_code = output.error_code
                live.discard(output.request_id)
    return answers


@dataclass
class Verdict:
    num_requests: int
    num_correct: int  # the whole fault-free answer
    num_error: int  # finish_reason "error" (the tokens before it are a correct prefix)
    num_aborted: int  # aborted by the driver (the tokens before it are a correct prefix)
    num_wrong: int  # a token that differs from the fault-free answer was returned
    wrong_request_ids: list[str]


def judge(answers: dict[str, Answer], reference: dict[str, list[int]]) -> Verdict:
    correct = error = aborted = 0
    wrong: list[str] = []
    for request_id, answer in answers.items():
        expected = reference[request_id]
        tokens = answer.token_ids
        if answer.finish_reason in ("error", "abort"):
            if tokens != expected[: len(tokens)]:
                wrong.append(request_id)
            elif answer.finish_reason == "error":
                error += 1
            else:
                aborted += 1
        elif tokens == expected:
            correct += 1
        else:
            wrong.append(request_id)
    return Verdict(len(answers), correct, error, aborted, len(wrong), wrong)


def random_prompts(
    count: int,
    seed: int,
    min_len: int,
    max_len: int,
    vocab: int,
    shared_prefixes: int = 0,
    prefix_len: int = 0,
) -> dict[str, list[int]]:
    """Random prompts; with `shared_prefixes`, each starts with one of that many common prefixes."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, vocab) for _ in range(prefix_len)] for _ in range(shared_prefixes)]
    prompts = {}
    for index in range(count):
        body = [rng.randrange(3, vocab) for _ in range(rng.randint(min_len, max_len))]
        prefix = prefixes[rng.randrange(len(prefixes))] if prefixes else []
        prompts[f"r{seed}-{index}"] = prefix + body
    return prompts
