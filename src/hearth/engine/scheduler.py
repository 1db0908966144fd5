"""Continuous batching with chunked prefill and preemption by recompute. Plain Python, no tensors.

Each step spends a token budget: running requests first (one token for a decode, the next chunk for
a prefill), oldest first; then draft tokens of running requests (speculative decoding), from what is
left, never at the cost of a preemption; then waiting requests, oldest first, while pages and seats
remain. When a running request needs a page and none is free, the most recently admitted running
request is preempted (its pages freed, to be recomputed later with help from the prefix cache) and
put back at the head of the waiting queue, so the oldest requests always make progress and nobody
starves.

A waiting request whose prompt KV can come from elsewhere (a peer, for the decode side of PD; a
lower cache tier, via the KV manager's lookup hook) is admitted to `WAITING_FOR_KV`: its pages are
allocated and listed in `SchedulerOutput.kv_loads`, and it holds a seat but is not scheduled until
`kv_arrived` (or `kv_failed`, which recomputes instead).

After the step, `update` records what the worker produced: progress, accepted tokens, rollback of
rejected drafts, and newly full pages for the prefix cache.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from hearth.engine.request import Request, RequestStatus
from hearth.engine.retention import SessionRetention
from hearth.kv.manager import KVCacheManager


@dataclass(slots=True)
class ScheduledRequest:
    """One row of a step: `num_new_tokens` query tokens at positions c .. c+num_new_tokens-1.

    With c = `request.num_computed_tokens`, the row's tokens are
    `request.token_ids[c : c + num_new_tokens - len(draft_token_ids)] + draft_token_ids`, and
    `request.page_ids` already covers every slot they write.
    """

    request: Request
    num_new_tokens: int
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """Whether this row reaches the end of the known tokens (drafts included), so it picks the next token.

        Read it before `Scheduler.update`, which advances the request.
        """
        end = self.request.num_computed_tokens + self.num_new_tokens
        return end == self.request.num_tokens + len(self.draft_token_ids)


@dataclass
class KVLoad:
    """KV for tokens [start_token, start_token + num_tokens) of a request, to be written into its pages.

    The leading `num_tier_tokens` (whole pages, named by `keys`) come from a lower cache tier, the rest
    from a peer (PD). `page_ids[i]` (with tag `page_generations[i]`) receives the request's page
    `start_token // page_size + i`. When done: `Scheduler.kv_arrived` (or `kv_failed`).
    """

    request: Request
    start_token: int
    num_tokens: int
    num_tier_tokens: int
    page_ids: list[int]
    page_generations: list[int]
    keys: list[bytes]


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    kv_loads: list[KVLoad] = field(default_factory=list)  # requests that entered WAITING_FOR_KV this step

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int) -> None:
        self.kv = kv
        self.retention: SessionRetention | None = None  # set by the factory when retention is on
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.waiting_for_kv: dict[str, Request] = {}  # hold seats and pages; not scheduled
        self.num_kv_load_failures = 0
        self.num_kv_recomputed_tokens = 0  # tokens promised by a tier or peer that were recomputed instead

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.waiting_for_kv)

    def add(self, request: Request, kv_pending_tokens: int = 0) -> None:
        """Queue a request.

        `kv_pending_tokens`: the KV of its leading tokens will come from a peer (PD decode side). At
        admission the scheduler allocates pages for those past what the prefix caches hold, parks the
        request in `WAITING_FOR_KV` and lists a `KVLoad`; when the caches hold them all, no load is
        listed and the request just runs (the peer's transfer is not needed). One prompt token is
        always computed here.
        """
        request.num_remote_kv_tokens = kv_pending_tokens
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        if self.retention is not None:
            self.retention.expire()
        return self._schedule()

    def _schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        running = self.running
        kv = self.kv
        page_size = kv.page_size
        index = 0
        while index < len(running) and budget > 0:
            request = running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:  # nothing to compute (cannot happen for a live request; be safe)
                index += 1
                continue
            # Most decode steps stay inside the last page: skip the allocator call then.
            end = request.num_computed_tokens + num_new
            if end > len(request.page_ids) * page_size and not self._make_room(request, num_new, out):
                break  # the request itself was preempted; everything after it already was too
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
            index += 1
        if out.preempted:
            return self._ordered(out)  # pages are short: no drafts, no admissions
        if budget > 0:
            budget = self._add_drafts(out.scheduled, budget)
        waiting = self.waiting
        while waiting and budget > 0 and len(running) + len(self.waiting_for_kv) < self.max_num_seqs:
            request = waiting[0]
            cached = pending = num_tier = 0
            # A request that wants prompt logprobs computes its whole prompt (hearth.engine.prompt_logprobs).
            if (
                request.num_computed_tokens == 0
                and not request.page_ids
                and request.params.prompt_logprobs is None
            ):
                prompt_len = request.num_prompt_tokens
                cached = kv.match_prefix(request, prompt_len)
                num_tier = kv.match_lower_tier(request, prompt_len)
                num_remote = min(request.num_remote_kv_tokens, request.num_tokens - 1) - cached - num_tier
                pending = num_tier + max(num_remote, 0)
            num_new = pending or min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._allocate(request, num_new):
                # Not enough pages yet: give back the prefix pages so they stay evictable, try next step.
                kv.free(request)
                break
            waiting.popleft()
            request.num_remote_kv_tokens = 0  # a peer sends once; after a preemption the request recomputes
            if pending:
                self._wait_for_kv(request, pending, num_tier, out)
                continue
            if request.cached_tokens is None:
                request.cached_tokens = cached
                request.cached_tokens_by_source = (cached, 0, 0, 0)
            request.status = RequestStatus.RUNNING
            if request.queue_time_s is None:  # vllm:request_queue_time_seconds (its first admission only)
                request.queue_time_s = time.monotonic() - request.arrival_s
            running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
        return self._ordered(out)

    def _make_room(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Pages for a running request's next tokens, preempting the newest running requests as needed.

        False when the request itself had to be preempted.
        """
        while not self._allocate(request, num_new):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is request:
                return False
        return True

    def _allocate(self, request: Request, num_new: int) -> bool:
        """Pages for the request's next tokens; sessions retained between turns give theirs up (oldest first)
        before a request waits or is preempted: retention only ever uses pages nobody else needs."""
        while not self.kv.allocate_slots(request, num_new):
            if self.retention is None or not self.retention.yield_oldest():
                return False
        return True

    def _add_drafts(self, scheduled: list[ScheduledRequest], budget: int) -> int:
        """Extend decode rows with their request's drafts from the budget left; returns what remains.

        Drafts are dropped, never paid for with a preemption: pages for them come from free or
        evictable pages only. A row takes at most as many drafts as the request may still output
        tokens beyond the one the row samples anyway, so it never passes max_tokens or max_model_len.
        """
        kv = self.kv
        for item in scheduled:
            request = item.request
            drafts = request.draft_token_ids
            if not drafts:
                continue
            if request.num_computed_tokens + item.num_new_tokens != request.num_tokens:
                continue  # a prefill chunk that stops short of the end samples nothing to verify against
            room = request.max_output_tokens - len(request.output_token_ids) - 1
            num_drafts = min(len(drafts), budget, room)
            if num_drafts <= 0 or not kv.allocate_slots(request, item.num_new_tokens + num_drafts):
                continue
            item.num_new_tokens += num_drafts
            item.draft_token_ids = drafts[:num_drafts]
            budget -= num_drafts
            if budget == 0:
                break
        return budget

    def _wait_for_kv(self, request: Request, pending: int, num_tier: int, out: SchedulerOutput) -> None:
        page_size = self.kv.page_size
        start = request.num_computed_tokens
        first, end = start // page_size, -(-(start + pending) // page_size)
        request.status = RequestStatus.WAITING_FOR_KV
        request.num_pending_kv_tokens = pending
        request.num_pending_tier_tokens = num_tier
        self.waiting_for_kv[request.request_id] = request
        out.kv_loads.append(
            KVLoad(
                request,
                start,
                pending,
                num_tier,
                request.page_ids[first:end],
                request.page_generations[first:end],
                request.page_keys[first : first + num_tier // page_size],
            )
        )

    def kv_arrived(self, request: Request, num_tokens: int, num_store_tokens: int = 0) -> bool:
        """The KV of the first `num_tokens` of a `WAITING_FOR_KV` request's pending tokens is in place.

        The request becomes runnable with those tokens computed; pending tokens past them (a partial
        load) are recomputed in the pages already allocated; `num_store_tokens` of the tier's part came
        from a shared store (usage tells sources apart). Returns False, doing nothing, when the
        request no longer waits for KV (finished or aborted meanwhile).
        """
        if self.waiting_for_kv.get(request.request_id) is not request:
            return False
        pending = request.num_pending_kv_tokens
        if not 0 <= num_tokens <= pending:
            raise ValueError(f"{num_tokens} tokens arrived for a load of {pending}")
        del self.waiting_for_kv[request.request_id]
        if request.cached_tokens is None:
            # Tier pages count as cached (usage tells where prompt tokens came from); a peer's don't.
            from_tier = min(num_tokens, request.num_pending_tier_tokens)
            num_device = request.num_computed_tokens
            request.cached_tokens = num_device + from_tier
            from_store = min(num_store_tokens, from_tier)
            request.cached_tokens_by_source = (
                num_device,
                from_tier - from_store,
                from_store,
                num_tokens - from_tier,
            )
        request.num_computed_tokens += num_tokens
        self.num_kv_recomputed_tokens += pending - num_tokens
        request.num_pending_kv_tokens = request.num_pending_tier_tokens = 0
        if request.queue_time_s is None:
            request.queue_time_s = time.monotonic() - request.arrival_s
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self.kv.cache_full_pages(request)
        return True

    def kv_failed(self, request: Request) -> bool:
        """A load failed: the request recomputes the pending tokens (its pages are kept)."""
        if self.waiting_for_kv.get(request.request_id) is not request:
            return False
        self.num_kv_load_failures += 1
        return self.kv_arrived(request, 0)

    def update(self, batch: list[ScheduledRequest], accepted_tokens: list[list[int]]) -> None:
        """Record a step's results: `accepted_tokens[i]` are the tokens kept for `batch[i]`.

        [] for a row that samples nothing (or whose tokens the engine drops). For a sampling row with
        kept tokens t1..tm, t1..t(m-1) equal the row's first m-1 drafts (their KV was written this
        step) and tm is new. The tokens are appended to the request, its computed count advances
        past the accepted drafts, the KV of rejected drafts is rolled back, newly full pages are
        cached, and the request's drafts are cleared. A request finished since `schedule()` is skipped.
        """
        kv = self.kv
        page_size = kv.page_size
        running = RequestStatus.RUNNING
        for item, tokens in zip(batch, accepted_tokens, strict=True):
            request = item.request
            if request.status is not running:
                continue
            drafts = item.draft_token_ids
            computed = request.num_computed_tokens + item.num_new_tokens - len(drafts)
            if tokens:
                if computed != request.num_tokens:
                    raise ValueError(f"request {request.request_id}: tokens for a row that samples nothing")
                num_accepted = len(tokens) - 1
                if num_accepted and (
                    num_accepted > len(drafts) or tokens[:num_accepted] != drafts[:num_accepted]
                ):
                    raise ValueError(f"request {request.request_id}: kept {tokens} do not extend drafts")
                computed += num_accepted
                request.token_ids += tokens
                request.output_token_ids += tokens
            request.num_computed_tokens = computed
            if drafts:
                kv.truncate(request, computed)  # drop the rejected drafts' KV and the pages only they used
            if request.draft_token_ids:
                request.draft_token_ids = []
            if computed >= (request.cached_page_count + 1) * page_size:
                kv.cache_full_pages(request)

    @staticmethod
    def _ordered(out: SchedulerOutput) -> SchedulerOutput:
        # Single-token rows first: the runner attends to them as one batch.
        out.scheduled.sort(key=lambda s: s.num_new_tokens != 1)
        return out

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def recompute(self, request: Request, suspect_page_indices: list[int]) -> None:
        """A running request whose page table failed the integrity check goes back through the preemption
        path: its pages are released (the suspect ones never reused from the prefix cache) and it waits, at
        the head of the queue, to be recomputed from its tokens so far."""
        self.running.remove(request)
        self.kv.forget_cached_pages(request, suspect_page_indices)
        request.draft_token_ids = []  # proposed for this very context: still valid, but re-proposed anyway
        self._preempt(request)

    def forget_suspect_pages(self, request: Request, suspect_page_indices: list[int]) -> None:
        """Before a request that failed the integrity check is finished: its suspect pages stay uncached."""
        self.kv.forget_cached_pages(request, suspect_page_indices)

    def finish(self, request: Request) -> None:
        """Remove a finished or aborted request wherever it is and free its pages (a session's turn that
        ended normally has them retained first, when retention is on)."""
        session = request.params.retain_session
        if self.retention is not None and session and request.finish_reason in ("stop", "length"):
            self.retention.retain(session, request)
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        elif request.status is RequestStatus.WAITING_FOR_KV:
            self.waiting_for_kv.pop(request.request_id, None)
        self.kv.free(request)
        request.status = RequestStatus.FINISHED
