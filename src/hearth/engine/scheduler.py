"""Continuous batching with chunked prefill and preemption by recompute. Plain Python, no tensors.

Each step spends a token budget: running requests first (one token for a decode, the next chunk for
a prefill), oldest first; then waiting requests, oldest first, while pages and seats remain. When a
running request needs a page and none is free, the most recently admitted running request is
preempted (its pages freed, to be recomputed later with help from the prefix cache) and put back at
the head of the waiting queue, so the oldest requests always make progress and nobody starves.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from hearth.engine.request import Request, RequestStatus
from hearth.kv.manager import KVCacheManager


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the known tokens, so its last logits pick the next token."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int) -> None:
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:  # nothing to compute (cannot happen for a live request; be safe)
                index += 1
                continue
            while not self.kv.allocate_slots(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                out.scheduled.append(ScheduledRequest(request, num_new))
                budget -= num_new
                index += 1
                continue
            break  # the request itself was preempted; everything after it already was too
        if out.preempted:
            return self._ordered(out)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            cached = 0
            if request.num_computed_tokens == 0 and not request.page_ids:
                cached = self.kv.match_prefix(request, request.num_prompt_tokens)
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self.kv.allocate_slots(request, num_new):
                # Not enough pages yet: give back the prefix pages so they stay evictable, try next step.
                self.kv.free(request)
                break
            self.waiting.popleft()
            if request.cached_tokens is None:
                request.cached_tokens = cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
        return self._ordered(out)

    @staticmethod
    def _ordered(out: SchedulerOutput) -> SchedulerOutput:
        # Single-token rows first: the runner attends to them as one batch.
        out.scheduled.sort(key=lambda s: s.num_new_tokens != 1)
        return out

    def update(self, batch: list[ScheduledRequest], accepted_tokens: list[list[int]]) -> None:
        """After a step: `accepted_tokens[i]` are the new tokens of `batch[i]` ([] for a mid-prompt chunk)."""
        for item, tokens in zip(batch, accepted_tokens):
            request = item.request
            request.num_computed_tokens += item.num_new_tokens
            request.token_ids.extend(tokens)
            request.output_token_ids.extend(tokens)
            self.kv.cache_full_pages(request)

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def finish(self, request: Request) -> None:
        """Remove a finished or aborted request wherever it is and free its pages."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        self.kv.free(request)
        request.status = RequestStatus.FINISHED
