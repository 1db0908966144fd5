"""The engine core's half of the step protocol: each step's `StepInput` deltas (`hearth.contracts.step`).

`StepInputBuilder` remembers, per request, what the workers already hold (its slot, how many of its tokens,
which pages), so a step carries only what changed: a request's prompt and sampler parameters once, the
token(s) sampled last step, pages added (or a table cut back by a rollback or replaced after preemption),
finished slots. It runs every step: per row and per changed page, never per token or per held page.

Row contract (the scheduler's): a `ScheduledRequest(request, num_new_tokens, draft_token_ids)` row computes
`request.token_ids[c : c + num_new_tokens - len(drafts)] + drafts` at positions `c .. c + num_new_tokens - 1`
(`c = request.num_computed_tokens`); its pages (`request.page_ids`) already cover every slot. A row that
`samples` gets 1 + len(drafts) logits positions, its last known token and each draft.

Overlap scheduling (`hearth.engine.overlap`) builds a step before the previous one's tokens are read:
`build(..., previous_rows=...)` makes every row one position past `num_computed_tokens`, its input token the
one the previous step samples for sampled row `previous_rows[r]`, which the workers append themselves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from hearth.contracts.step import NewRequest, PageUpdate, StepInput

if TYPE_CHECKING:
    from hearth.engine.request import Request
    from hearth.engine.scheduler import ScheduledRequest
    from hearth.engine.structured_output import GrammarMatcher, StructuredOutputManager


@dataclass(slots=True)
class _Sent:
    """What the workers hold of one request."""

    slot: int
    num_tokens: int
    pages: list[int] = field(default_factory=list)  # the workers' copy of its page table, and tags
    tags: list[int] = field(default_factory=list)


class StepInputBuilder:
    """Builds each step's `StepInput`; collects what happened in between: requests that finished, and
    pages handed out (`KVCacheManager.take_allocated`) whose tags the pool needs.

    `check_page_tags`: the expected tag of every page is sent with it (the workers' integrity check).
    """

    def __init__(self, page_size: int, check_page_tags: bool = False) -> None:
        self.page_size = page_size
        self.check_page_tags = check_page_tags
        self._sent: dict[str, _Sent] = {}
        self._free_slots: list[int] = []
        self._num_slots = 0
        self._finished_slots: list[int] = []
        self._tag_page_ids: list[int] = []
        self._tag_values: list[int] = []

    def request_finished(self, request_id: str) -> None:
        """The workers drop the request's state before the next step runs."""
        sent = self._sent.pop(request_id, None)
        if sent is not None:
            self._finished_slots.append(sent.slot)

    def pages_allocated(self, page_ids: Sequence[int], tags: Sequence[int]) -> None:
        """Pages whose tags the pool gets with the next step (a page handed out twice: the last tag wins)."""
        self._tag_page_ids.extend(page_ids)
        self._tag_values.extend(tags)

    def _new_slot(self) -> int:
        if self._free_slots:
            return self._free_slots.pop()
        self._num_slots += 1
        return self._num_slots - 1

    def build(
        self,
        scheduled: Sequence[ScheduledRequest],
        structured: StructuredOutputManager | None = None,
        previous_rows: list[int] | None = None,
    ) -> StepInput:
        """The step's deltas. `previous_rows`: an overlapped continuation (see the module docstring); its
        rows are plain decode rows of requests the workers already hold."""
        sent_by_id = self._sent
        check_tags = self.check_page_tags
        finished_slots, self._finished_slots = self._finished_slots, []
        # Slots freed by this step's finished requests are reusable now: the workers drop before they add.
        self._free_slots.extend(finished_slots)
        tag_page_ids, self._tag_page_ids = self._tag_page_ids, []
        tag_values, self._tag_values = self._tag_values, []
        if len(set(tag_page_ids)) < len(tag_page_ids):  # one tensor write per page: keep each page's last tag
            latest = dict(zip(tag_page_ids, tag_values, strict=True))
            tag_page_ids, tag_values = list(latest), list(latest.values())
        slots: list[int] = []
        starts: list[int] = []
        num_new_tokens: list[int] = []
        num_appended: list[int] = []
        appended: list[int] = []
        num_drafts: list[int] = []
        draft_token_ids: list[int] = []
        non_sampling: list[int] = []
        new_requests: list[NewRequest] = []
        page_updates: list[PageUpdate] = []
        constrained: list[tuple[int, GrammarMatcher, list[int]]] = []
        num_logits = 0
        any_drafts = False
        for row, item in enumerate(scheduled):
            request = item.request
            tokens = request.token_ids
            sent = sent_by_id.get(request.request_id)
            if sent is not None and sent.num_tokens > len(tokens):
                # The workers appended a token the request never kept (an overlapped row after a step
                # whose row was sent back to recompute): the request is sent again under its slot.
                sent.num_tokens, sent.pages, sent.tags = len(tokens), [], []
                new_requests.append(self._new_request(sent.slot, request))
                num_appended.append(0)
            elif sent is None:
                sent = sent_by_id[request.request_id] = _Sent(self._new_slot(), len(tokens))
                new_requests.append(self._new_request(sent.slot, request))
                num_appended.append(0)
            elif previous_rows is not None:
                sent.num_tokens += 1  # the workers append the token the previous step samples for it
                num_appended.append(0)
            elif sent.num_tokens < len(tokens):
                appended.extend(tokens[sent.num_tokens :])
                num_appended.append(len(tokens) - sent.num_tokens)
                sent.num_tokens = len(tokens)
            else:
                num_appended.append(0)
            # Compared whole (a C loop over a few ints a row): any change reaches the workers, even one
            # that is a bug here, so their integrity check sees the table this core believes in.
            if request.page_ids != sent.pages or request.page_generations != sent.tags:
                page_updates.append(self._page_update(sent, request.page_ids, request.page_generations))
            slots.append(sent.slot)
            starts.append(request.num_computed_tokens + (previous_rows is not None))
            num_new_tokens.append(item.num_new_tokens)
            drafts = item.draft_token_ids
            num_drafts.append(len(drafts))
            if drafts:
                any_drafts = True
                draft_token_ids.extend(drafts)
            if item.samples:
                if request.grammar is not None:
                    constrained.append((num_logits, request.grammar, drafts))
                num_logits += 1 + len(drafts)
            else:
                non_sampling.append(row)
        step = StepInput(
            slots=slots,
            starts=starts,
            num_new_tokens=num_new_tokens,
            num_appended_tokens=num_appended if appended else [],
            appended_token_ids=appended,
            num_draft_tokens=num_drafts if any_drafts else [],
            draft_token_ids=draft_token_ids,
            non_sampling_rows=non_sampling,
            new_requests=new_requests,
            page_updates=page_updates,
            finished_slots=finished_slots,
            tag_page_ids=tag_page_ids,
            tag_values=tag_values,
            previous_rows=previous_rows or [],
        )
        if not check_tags:
            for update in page_updates:
                update.page_tags = []
        if constrained:
            if structured is None:
                raise ValueError("constrained rows in the batch, but no StructuredOutputManager to mask them")
            self._add_bitmask(step, constrained, structured)
        return step

    @staticmethod
    def _new_request(slot: int, request: Request) -> NewRequest:
        return NewRequest(
            slot,
            request.request_id,
            request.num_prompt_tokens,
            list(request.token_ids),
            request.params.sampler_params(),
        )

    @staticmethod
    def _page_update(sent: _Sent, pages: list[int], tags: list[int]) -> PageUpdate:
        """What turns the workers' copy of a request's page table into `pages`: the common prefix is kept."""
        old_pages, old_tags = sent.pages, sent.tags
        keep = 0
        limit = min(len(old_pages), len(pages))
        while keep < limit and old_pages[keep] == pages[keep] and old_tags[keep] == tags[keep]:
            keep += 1
        sent.pages = list(pages)
        sent.tags = list(tags)
        return PageUpdate(sent.slot, keep, pages[keep:], tags[keep:])

    @staticmethod
    def _add_bitmask(
        step: StepInput,
        constrained: list[tuple[int, GrammarMatcher, list[int]]],
        structured: StructuredOutputManager,
    ) -> None:
        """Grammar masks: rows without drafts in one batched call; a row with drafts gets one mask per
        position its grammar reaches (see `StructuredOutputManager.compute_draft_bitmask`)."""
        plain = [(row, matcher) for row, matcher, drafts in constrained if not drafts]
        rows = [row for row, _ in plain]
        parts = [structured.compute_bitmask([matcher for _, matcher in plain])[1]] if plain else []
        for row, matcher, drafts in constrained:
            if drafts:
                words = structured.compute_draft_bitmask(matcher, drafts)
                rows.extend(range(row, row + words.shape[0]))
                parts.append(words)
        step.bitmask_rows = rows
        step.bitmask = (parts[0] if len(parts) == 1 else torch.cat(parts)).numpy().tobytes()
