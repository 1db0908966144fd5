"""What the engine does about KV pages that fail the integrity check (`hearth.kv.integrity`).

Worker side, `without_rows`: the rows whose page tables fail are cut out of the step before the model
runs, so they neither read another request's KV nor write into pages that now belong to someone else.

Engine side, `KVIntegrityPolicy`: each failing request is logged (request id, page id, expected and found
tag) and counted; with `recompute` (the default) a failure sends it back through the preemption path (its
pages released, the suspect ones never reused from the prefix cache) to be recomputed from its tokens so
far. Its second failure, whenever it happens, ends it with finish_reason "error" (the issue's rule: a
request is recomputed at most once, so a fault that persists cannot make it loop). With `abort` the first
failure ends it. The failing step's tokens are never returned.
"""

from __future__ import annotations

import logging
from bisect import bisect_right
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from hearth.engine.step_input import StepInput
from hearth.kv.integrity import PageTagMismatch

if TYPE_CHECKING:
    from hearth.engine.request import Request
    from hearth.engine.scheduler import ScheduledRequest, Scheduler

logger = logging.getLogger("hearth.integrity")

KVIntegrityAction = Literal["recompute", "abort"]  # EngineConfig.KV_INTEGRITY_ACTIONS
KV_INTEGRITY_ERROR = "kv_integrity_error"  # the error code clients see (OpenAI error object, `code`)
MAX_FAILURES = 2  # a request's failures: the first is recomputed, this many end it with an error


def without_rows(step: StepInput, rows: Iterable[int]) -> tuple[StepInput, list[int]]:
    """The step without `rows`, and the indices (into `step.sampling`) of the sampling rows it keeps.

    Only the failure path calls this. Tags of newly handed-out pages and finished requests were applied
    already, so the returned step carries neither; the page table keeps its width.
    """
    dropped = set(rows)
    starts = step.query_start_loc
    width = step.page_table_width
    token_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    query_start_loc = [0]
    seq_lens: list[int] = []
    page_table: list[int] = []
    page_tags: list[int] = []
    new_start: dict[int, int] = {}  # kept row -> its first token in the new flat batch
    num_decode_rows = 0
    for row in range(step.num_rows):
        if row in dropped:
            continue
        begin, end = starts[row], starts[row + 1]
        new_start[row] = len(token_ids)
        token_ids += step.token_ids[begin:end]
        positions += step.positions[begin:end]
        slot_mapping += step.slot_mapping[begin:end]
        query_start_loc.append(len(token_ids))
        seq_lens.append(step.seq_lens[row])
        page_table += step.page_table[row * width : (row + 1) * width]
        if step.page_tags:
            page_tags += step.page_tags[row * width : (row + 1) * width]
        if row < step.num_decode_rows:
            num_decode_rows += 1
    logits_indices: list[int] = []
    new_logits_position: dict[int, int] = {}  # old index into logits_indices -> new one
    kept_sampling: list[int] = []
    position = 0
    for index, sampling_row in enumerate(step.sampling):
        count = sampling_row.num_logits
        row = bisect_right(starts, step.logits_indices[position]) - 1
        if row in new_start:
            kept_sampling.append(index)
            for old in range(position, position + count):
                new_logits_position[old] = len(logits_indices)
                logits_indices.append(step.logits_indices[old] - starts[row] + new_start[row])
        position += count
    bitmask_rows: list[int] = []
    bitmask = b""
    if step.bitmask_rows:
        row_bytes = len(step.bitmask) // len(step.bitmask_rows)
        parts = []
        for mask_index, old in enumerate(step.bitmask_rows):
            if old in new_logits_position:
                bitmask_rows.append(new_logits_position[old])
                parts.append(step.bitmask[mask_index * row_bytes : (mask_index + 1) * row_bytes])
        bitmask = b"".join(parts)
    kept = StepInput(
        token_ids=token_ids,
        positions=positions,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        num_decode_rows=num_decode_rows,
        page_table=page_table,
        page_table_width=width if seq_lens else 0,
        slot_mapping=slot_mapping,
        logits_indices=logits_indices,
        sampling=[step.sampling[index] for index in kept_sampling],
        page_tags=page_tags,
        bitmask_rows=bitmask_rows,
        bitmask=bitmask,
    )
    return kept, kept_sampling


@dataclass
class KVIntegrityPolicy:
    """The engine's answer to a step's mismatches: recompute the request once, then fail it."""

    scheduler: Scheduler
    action: KVIntegrityAction = "recompute"
    num_failures: int = 0  # failing request-steps, for `hearth_kv_integrity_failures_total`
    num_recomputed: int = 0

    def handle(
        self, batch: list[ScheduledRequest], mismatches: list[PageTagMismatch]
    ) -> list[tuple[Request, str]]:
        """Take every failing row's request off the running set; returns those that end, with their error.

        The others are back in the waiting queue, to recompute. Call before `Scheduler.update`, which then
        skips them (they are no longer running), so none of the step's tokens for them is kept.
        """
        by_row: dict[int, list[PageTagMismatch]] = {}
        for mismatch in mismatches:
            by_row.setdefault(mismatch.row, []).append(mismatch)
        failed: list[tuple[Request, str]] = []
        for row, entries in by_row.items():
            request = batch[row].request
            self.num_failures += 1
            request.num_kv_integrity_failures += 1
            for entry in entries:
                logger.error(
                    "KV integrity: request %s page %d (logical page %d) expected tag %d, found %d",
                    request.request_id,
                    entry.page_id,
                    entry.page_index,
                    entry.expected_tag,
                    entry.found_tag,
                )
            suspect = [entry.page_index for entry in entries]
            if self.action == "recompute" and request.num_kv_integrity_failures < MAX_FAILURES:
                self.scheduler.recompute(request, suspect)
                self.num_recomputed += 1
                logger.warning("KV integrity: request %s is recomputed from its tokens", request.request_id)
            else:
                self.scheduler.forget_suspect_pages(request, suspect)
                failed.append(
                    (
                        request,
                        f"KV cache integrity check failed {request.num_kv_integrity_failures} time(s): "
                        f"page {entries[0].page_id} expected tag {entries[0].expected_tag}, "
                        f"found {entries[0].found_tag}",
                    )
                )
        return failed
