"""`PeerKVConnector`: the scheduler half of PD transfer. It decides; every rank's `KVWorker` moves its
own shard over its own transport (`hearth.kv_transfer`).

Decode role: a request that arrives with `kv_transfer.role == "decode"` is promised its prompt's KV
(all but the last prompt token, which the decode server computes to start the answer). The scheduler
allocates pages past the decode server's own prefix hit and lists a load; `start_load` opens the
transfer on every rank for exactly those pages, so only missing pages move. The load ends when every
rank's shard arrived (or one failed), or when `timeout_s` passes; a failed load is recomputed, never
an error.

Prefill role: when a request with `kv_transfer.role == "prefill"` ends, `request_finished` (which runs
before its pages are freed) takes an extra reference on the pages that hold its prompt's KV and has
every rank send its shard; the references are dropped only when every rank reported its send, so
those pages cannot be reused while a sender reads them. The engine holds the request's last output
back until then (`is_sending` / `poll_sent`), so the prefill answer says whether the KV was sent.
"""

from __future__ import annotations

import logging
import time

from hearth.contracts.kv_ops import KVEvent, PeerClose, PeerReceive, PeerSend
from hearth.engine.kv_connector import KVConnector, KVLoadPart, KVLoadResult, KVOpQueue, RankEvents
from hearth.engine.request import Request, RequestStatus
from hearth.kv.manager import KVCacheManager
from hearth.kv_transfer.base import prompt_hash

logger = logging.getLogger("hearth.kv_transfer")


class PeerKVConnector(KVConnector):
    source = "peer"

    def __init__(
        self,
        ops: KVOpQueue,
        kv: KVCacheManager,
        timeout_s: float,
        world_size: int,
        wakeup_fd: int | None = None,
    ) -> None:
        self.ops = ops
        self.kv = kv
        self.page_size = kv.page_size
        self.timeout_s = timeout_s
        self._wakeup_fd = wakeup_fd
        self._expected: dict[str, Request] = {}  # decode requests promised KV, no load started yet
        self._loads: dict[
            str, tuple[str, KVLoadPart, float]
        ] = {}  # request id -> (transfer id, part, deadline)
        self._received = RankEvents(world_size)  # by transfer id
        self._sending: dict[str, tuple[str, list[int]]] = {}  # transfer id -> (request id, held pages)
        self._sent_answers = RankEvents(world_size)
        self._sending_requests: set[str] = set()
        self._sent: list[tuple[str, bool]] = []
        self._results: list[KVLoadResult] = []
        self.num_receive_failures = 0
        self.num_send_failures = 0
        self.num_pages_received = 0
        self.num_pages_sent = 0

    # ---- decode side ----------------------------------------------------------------------------

    def request_added(self, request: Request) -> int:
        transfer = request.kv_transfer
        if transfer is None or transfer.role != "decode":
            return 0
        self._expected[request.request_id] = request
        return max(request.num_prompt_tokens - 1, 0)

    def start_load(self, part: KVLoadPart) -> None:
        request = part.request
        self._expected.pop(request.request_id, None)
        transfer = request.kv_transfer
        if transfer is None:
            self._results.append(KVLoadResult(request.request_id, "peer", 0))
            return
        self._loads[request.request_id] = (transfer.transfer_id, part, time.monotonic() + self.timeout_s)
        self._received.expect(transfer.transfer_id)
        self.ops.add(
            PeerReceive(
                request.request_id,
                transfer.transfer_id,
                part.start_token // self.page_size,
                list(part.page_ids),
                part.start_token + part.num_tokens,
                prompt_hash(request.prompt_token_ids),
            )
        )

    def on_events(self, events: list[KVEvent]) -> None:
        for event in events:
            if event.kind == "received":
                answers = self._received.add(event.transfer_id, event)
                if answers is not None:
                    self._load_answered(event.request_id, answers)
            elif event.kind == "sent":
                answers = self._sent_answers.add(event.transfer_id, event)
                if answers is not None:
                    self._send_answered(event.transfer_id, answers)

    def _load_answered(self, request_id: str, answers: list[KVEvent]) -> None:
        entry = self._loads.pop(request_id, None)
        if entry is None:
            return
        transfer_id, part, _ = entry
        failed = [a for a in answers if not a.ok]
        if failed:
            self.num_receive_failures += 1
            self.ops.add(PeerClose(transfer_id))  # the ranks still receiving stop writing
            logger.warning(
                "KV transfer %s failed on rank %d (%s); request %s recomputes its prompt",
                transfer_id,
                failed[0].rank,
                failed[0].detail,
                request_id,
            )
        else:
            self.num_pages_received += answers[0].num_pages
        self._results.append(KVLoadResult(request_id, "peer", 0 if failed else part.num_tokens))

    def _send_answered(self, transfer_id: str, answers: list[KVEvent]) -> None:
        entry = self._sending.pop(transfer_id, None)
        if entry is None:
            return
        request_id, pages = entry
        self.kv.release_pages(pages)  # every rank's sender is done reading them
        self._sending_requests.discard(request_id)
        ok = all(a.ok for a in answers)
        self._sent.append((request_id, ok))
        if ok:
            self.num_pages_sent += answers[0].num_pages
        else:
            self.num_send_failures += 1

    def poll(self) -> list[KVLoadResult]:
        results, self._results = self._results, []
        if self._loads:
            now = time.monotonic()
            for request_id, (transfer_id, _part, deadline) in list(self._loads.items()):
                if now >= deadline:
                    self._end_load(request_id)
                    self.num_receive_failures += 1
                    logger.warning(
                        "KV transfer %s timed out after %.1f s; request %s recomputes its prompt",
                        transfer_id,
                        self.timeout_s,
                        request_id,
                    )
                    results.append(KVLoadResult(request_id, "peer", 0))
        if self._expected:
            for request_id, request in list(self._expected.items()):
                if request.status is RequestStatus.RUNNING:  # its own cache held it all: nothing to receive
                    del self._expected[request_id]
                    assert request.kv_transfer is not None
                    self.ops.add(PeerClose(request.kv_transfer.transfer_id))
        return results

    def _end_load(self, request_id: str) -> None:
        entry = self._loads.pop(request_id, None)
        if entry is not None:
            self._received.forget(entry[0])
            self.ops.add(PeerClose(entry[0]))  # runs on every rank before a step can reuse the pages

    def cancel(self, request_id: str) -> None:
        self._end_load(request_id)

    @property
    def in_flight(self) -> bool:
        return bool(self._loads) or bool(self._sending)

    # ---- both -----------------------------------------------------------------------------------

    def request_finished(self, request: Request) -> None:
        transfer = request.kv_transfer
        if transfer is None:
            return
        if transfer.role == "decode":
            self._expected.pop(request.request_id, None)
            self._end_load(request.request_id)
            self.ops.add(PeerClose(transfer.transfer_id))  # a sender that comes later is told no
            return
        if transfer.role != "prefill" or not transfer.peer:
            return
        # Aborted or failed: send nothing, but tell the decode side at once (it recomputes).
        complete = request.finish_reason in ("stop", "length")
        num_tokens = min(request.num_computed_tokens, request.num_prompt_tokens) if complete else 0
        pages = list(request.page_ids[: -(-num_tokens // self.page_size)])
        self.kv.hold_pages(pages)
        self._sending[transfer.transfer_id] = (request.request_id, pages)
        self._sent_answers.expect(transfer.transfer_id)
        self._sending_requests.add(request.request_id)
        self.ops.add(
            PeerSend(
                request.request_id,
                transfer.transfer_id,
                transfer.peer,
                pages,
                num_tokens,
                prompt_hash(request.prompt_token_ids),
            )
        )

    def is_sending(self, request_id: str) -> bool:
        return request_id in self._sending_requests

    def poll_sent(self) -> list[tuple[str, bool]]:
        sent, self._sent = self._sent, []
        return sent

    @property
    def busy(self) -> bool:
        return bool(self._sending)

    @property
    def wakeup_fd(self) -> int | None:
        return self._wakeup_fd

    def counters(self) -> dict[str, int]:
        return {
            "transfer_failures": self.num_receive_failures + self.num_send_failures,
            "transfer_pages_received": self.num_pages_received,
            "transfer_pages_sent": self.num_pages_sent,
        }
