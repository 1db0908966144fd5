"""Overlap scheduling: the host prepares step N+1 while the worker runs step N.

Steps run on one worker thread (`StepRunner`), in the order they are launched. After launching step N
the engine builds step N+1 without waiting for N's tokens when N+1 is a plain continuation of N: every
row of N a decode row (one token, no drafts) of a running request that samples, whose next row needs
nothing N's token decides on the host (no grammar mask, no penalties over the history), with nobody
waiting to be admitted, no KV arriving from elsewhere, and a free page for each row's next slot. Each
row of N+1 is then the same request one position further, its input token the one N samples for it:
the worker fills it in from its previous output (`StepInput.previous_rows`) just before the forward,
on its own thread. A request whose N token is its last (max_tokens) gets no N+1 row. Then the engine reads N's tokens and processes them as the
serial loop does; a request that ends at N (a stop token, max_tokens, an abort) has its N+1 row run
and dropped, as a request finished mid-step always is. Its KV write lands in pages it freed, before
any later step (launched after it, on the same thread and device stream) can reuse them.

Anything else (a prefill, an admission, a preemption, drafts, grammars, penalties, KV connectors) goes
through the scheduler as usual, one step at a time. On a GPU the worker thread launches kernels and
waits for tokens while the engine builds and processes; on a CPU the forward runs on that thread while
the engine's Python work runs beside it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from hearth.engine.request import Request, RequestStatus
from hearth.engine.scheduler import ScheduledRequest, Scheduler
from hearth.engine.step_input import StepInput, StepInputBuilder, StepSamplingRow
from hearth.kv.integrity import PADDING_TAG
from hearth.kv.manager import KVCacheManager


@dataclass
class LaunchedStep:
    """A step handed to the worker: its rows, which of them sample (read at launch: a request finished or
    preempted before the output is read has its progress reset), and its output when the worker is done."""

    batch: list[ScheduledRequest]
    samples: list[bool]
    output: Future  # Future[StepOutput]
    prompt_chunks: list | None = None  # hearth.engine.prompt_logprobs.plan's, filed when the output is read

    def result(self):  # -> StepOutput
        return self.output.result()


class StepRunner:
    """Runs `execute(step)` for each launched step: on one background thread (overlap), or at once."""

    def __init__(self, execute: Callable, overlap: bool, device: torch.device | None = None) -> None:
        self._execute = execute
        self._thread = None
        if overlap:  # a new thread's current CUDA device is 0: make it the worker's
            on_device = device is not None and device.type == "cuda"
            initializer = (lambda: torch.cuda.set_device(device)) if on_device else None
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="hearth-step", initializer=initializer)

    @property
    def overlaps(self) -> bool:
        return self._thread is not None

    def launch(self, batch: list[ScheduledRequest], step: StepInput) -> LaunchedStep:
        samples = [item.samples for item in batch]
        if self._thread is not None:
            return LaunchedStep(batch, samples, self._thread.submit(self._execute, step))
        done: Future = Future()
        done.set_result(self._execute(step))
        return LaunchedStep(batch, samples, done)

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)


def continues(batch: Sequence[ScheduledRequest], scheduler: Scheduler) -> bool:
    """Whether the step after `batch` is `batch`'s decode rows one position further, whatever tokens it
    samples (read before `batch`'s output is processed)."""
    if not batch or scheduler.waiting or scheduler.waiting_for_kv:
        return False
    for item in batch:
        request = item.request
        if item.num_new_tokens != 1 or item.draft_token_ids or request.status is not RequestStatus.RUNNING:
            return False
        if not item.samples or request.grammar is not None or request.params.needs_penalties:
            return False
    return len(batch) == len(scheduler.running)


def continuation(
    batch: Sequence[ScheduledRequest], kv: KVCacheManager, builder: StepInputBuilder
) -> tuple[list[ScheduledRequest], StepInput] | None:
    """The next step of a `continues` batch, built before its tokens are known (None: no free page for a
    row's next slot; pages already taken for other rows stay with their requests, which use them next).
    A request whose token at N is its last (max_tokens) gets no row: it surely ends there."""
    page_size = kv.page_size
    previous_rows = [
        index
        for index, item in enumerate(batch)
        if len(item.request.output_token_ids) + 1 < item.request.max_output_tokens
    ]
    rows = [batch[index].request for index in previous_rows]
    if not rows:
        return None
    for request in rows:  # the slot after the row's token: position num_computed_tokens + 1
        if not kv.allocate_slots(request, 2):
            return None
    builder.pages_allocated(*kv.take_allocated())
    positions = [request.num_computed_tokens + 1 for request in rows]
    tables = [request.page_ids[: position // page_size + 1] for request, position in zip(rows, positions)]
    width = max(len(pages) for pages in tables)
    page_table: list[int] = []
    page_tags: list[int] = []
    for request, pages in zip(rows, tables):
        page_table += pages + [0] * (width - len(pages))
        if builder.check_page_tags:
            page_tags += request.page_generations[: len(pages)] + [PADDING_TAG] * (width - len(pages))
    finished, tag_page_ids, tag_values = builder.take_between_steps()
    step = StepInput(
        token_ids=[0] * len(rows),  # the worker puts the previous step's tokens here
        positions=positions,
        query_start_loc=list(range(len(rows) + 1)),
        seq_lens=[position + 1 for position in positions],
        num_decode_rows=len(rows),
        page_table=page_table,
        page_table_width=width,
        slot_mapping=[
            request.page_ids[position // page_size] * page_size + position % page_size
            for request, position in zip(rows, positions)
        ],
        logits_indices=list(range(len(rows))),
        sampling=[_sampling_row(request) for request in rows],
        page_tags=page_tags,
        tag_page_ids=tag_page_ids,
        tag_values=tag_values,
        finished_request_ids=finished,
        previous_rows=previous_rows,
    )
    return [ScheduledRequest(request, 1) for request in rows], step


def _sampling_row(request: Request) -> StepSamplingRow:
    # One more output token than now: the previous step's, appended before this step's output is read.
    return StepSamplingRow(
        request_id=request.request_id,
        params=request.params,
        num_output_tokens=len(request.output_token_ids) + 1,
    )
