"""What the engine does about KV pages that fail the integrity check (`hearth.kv.integrity`).

Worker side (`Worker.execute`): the rows whose page tables fail are masked out of the step before the model
runs (`PersistentBatch.flatten(step, skip_rows)`), so they neither read another request's KV nor write into
pages that now belong to someone else.

Engine side, `KVIntegrityPolicy`: each failing request is logged (request id, page id, expected and found
tag) and counted; with `recompute` (the default) a failure sends it back through the preemption path (its
pages released, the suspect ones never reused from the prefix cache) to be recomputed from its tokens so
far. Its second failure, whenever it happens, ends it with finish_reason "error" (the issue's rule: a
request is recomputed at most once, so a fault that persists cannot make it loop). With `abort` the first
failure ends it. The failing step's tokens are never returned.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from hearth.kv.integrity import PageTagMismatch

if TYPE_CHECKING:
    from hearth.engine.request import Request
    from hearth.engine.scheduler import ScheduledRequest, Scheduler

logger = logging.getLogger("hearth.integrity")

KVIntegrityAction = Literal["recompute", "abort"]  # EngineConfig.KV_INTEGRITY_ACTIONS
KV_INTEGRITY_ERROR = "kv_integrity_error"  # the error code clients see (OpenAI error object, `code`)
MAX_FAILURES = 2  # a request's failures: the first is recomputed, this many end it with an error


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
