"""`PeerKVConnector`: the engine's side of PD transfer, over a `KVTransport`.

Decode role: a request that arrives with `kv_transfer.role == "decode"` is promised its prompt's KV
(all but the last prompt token, which the decode server computes to start the answer). The scheduler
allocates pages past the decode server's own prefix hit and lists a load; `start_load` opens the
transfer for exactly those pages, so only missing pages move. The load ends when the pages arrived,
when the transport fails, or when `timeout_s` passes; a failed load is recomputed, never an error.

Prefill role: when a request with `kv_transfer.role == "prefill"` ends, `request_finished` (which runs
before its pages are freed) takes an extra reference on the pages that hold its prompt's KV and starts
the send; the references are dropped only when the transport reports the send finished or failed, so
those pages cannot be reused while the sender reads them. The engine holds the request's last output
back until then (`is_sending` / `poll_sent`), so the prefill answer says whether the KV was sent.

Everything here runs on the engine's thread; the transport's threads only write pages of open
transfers (under its lock) and report events.
"""

from __future__ import annotations

import logging
import time

import torch

from hearth.engine.kv_connector import KVConnector, KVLoadPart, KVLoadResult
from hearth.engine.request import Request, RequestStatus
from hearth.kv.convert import pool_scales, write_converted_pages
from hearth.kv.manager import KVCacheManager
from hearth.kv.pool import KVLayout, KVPool
from hearth.kv_transfer.base import (
    KVTransport,
    PageSink,
    ReceiveSpec,
    Scales,
    SendSpec,
    WireLayout,
    dtype_name,
    prompt_hash,
)

logger = logging.getLogger("hearth.kv_transfer")


def wire_layout(layout: KVLayout) -> WireLayout:
    return WireLayout(
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        page_size=layout.page_size,
        kind=layout.kind,
        dtype=dtype_name(layout.kv_dtype),
    )


def _paged(pool: KVPool) -> torch.Tensor:
    """The pool's storage as `[num_layers, 2, num_pages, page_size, heads, head_dim]` (a view)."""
    layout = pool.layout
    return pool.storage.view(
        layout.num_layers, 2, pool.num_pages, layout.page_size, layout.num_kv_heads, layout.head_dim
    )


def pool_bytes(pool: KVPool) -> memoryview:
    if pool.storage.device.type != "cpu":
        raise ValueError("page runs are CPU memory")
    return memoryview(pool.storage.view(torch.uint8).numpy()).cast("B")


def pool_page_runs(pool: KVPool, whole: memoryview, page_ids: list[int]) -> list[memoryview]:
    """The pool's bytes of `page_ids` as contiguous runs in wire order (page, layer, K/V): a page is
    `num_layers x num_planes` runs of `page_size x heads x head_dim` values. Plain memoryview slices
    (a tensor view per run would cost more than the copy it saves)."""
    layout = pool.layout
    run = layout.page_size * layout.num_kv_heads * layout.head_dim * pool.storage.element_size()
    plane_stride = pool.num_pages * run
    planes = [plane * plane_stride for plane in range(layout.num_layers * layout.num_planes)]
    return [
        whole[base + page_id * run : base + (page_id + 1) * run] for page_id in page_ids for base in planes
    ]


class PoolPageSource:
    """A request's held pages, read page-major for the wire.

    One `copy_` per page (a page is 2 x num_layers contiguous runs) rather than `read_pages`: the
    index_select over the page dimension plus the permute measured ~10x slower than these copies,
    which run at plain-memcpy speed (scripts/bench_kv_transfer.py).
    """

    def __init__(self, pool: KVPool, page_ids: list[int]) -> None:
        self.pool = pool
        self.page_ids = page_ids
        self._bytes: memoryview | None = None
        if pool.storage.device.type != "cpu":
            self.page_runs = None  # type: ignore[assignment]  # GPU pools: gathered into host memory

    @property
    def num_pages(self) -> int:
        return len(self.page_ids)

    @property
    def dtype(self) -> torch.dtype:
        return self.pool.layout.kv_dtype

    @property
    def scales(self) -> Scales | None:
        return pool_scales(self.pool)

    def page_runs(self, first: int, count: int) -> list[memoryview]:
        """Pages [first, first + count) as the contiguous byte runs of the pool that hold them, in wire
        order: the sender hands these to `sendmsg`, with no gather copy."""
        if self._bytes is None:
            self._bytes = pool_bytes(self.pool)
        return pool_page_runs(self.pool, self._bytes, self.page_ids[first : first + count])

    def read_into(self, first: int, count: int, out: torch.Tensor) -> None:
        paged = _paged(self.pool)
        for index, page_id in enumerate(self.page_ids[first : first + count]):
            out[index].copy_(paged[:, :, page_id])


class PoolSink:
    """Writes wire pages into the pool; a different dtype or other FP8 scales are converted here (the
    receiver's job: precision per role, e.g. a BF16 prefill pool into an FP8 decode pool, quantized with
    the decode pool's own per-head scales; FP8 pages are first multiplied by the sender's scales).

    Pages that need no conversion get one `copy_` per page (a page is 2 x num_layers contiguous runs in
    the pool): measured ~3.5x faster than one `index_copy_` over the batch, which goes through a
    strided gather. Better still, a transport that can receive straight into the pool asks `page_runs`
    (same dtype, no scales: the bytes on the wire are the bytes to store).
    """

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self._bytes: memoryview | None = None

    def __call__(self, page_ids: list[int], data: torch.Tensor, src_scales: Scales | None = None) -> None:
        pool = self.pool
        if pool.quantized or src_scales is not None:
            write_converted_pages(pool, page_ids, data.permute(1, 2, 0, 3, 4, 5), src_scales)
            return
        paged = _paged(pool)
        for index, page_id in enumerate(page_ids):
            paged[:, :, page_id].copy_(data[index])  # a float dtype other than the pool's converts here

    def page_runs(self, page_ids: list[int], dtype: torch.dtype) -> list[memoryview] | None:
        """Where wire pages of `dtype` can be received as they are, or None (they need converting)."""
        pool = self.pool
        if dtype != pool.layout.kv_dtype or pool.quantized or pool.storage.device.type != "cpu":
            return None
        if self._bytes is None:
            self._bytes = pool_bytes(pool)
        return pool_page_runs(pool, self._bytes, page_ids)


def pool_sink(pool: KVPool) -> PageSink:
    return PoolSink(pool)


class PeerKVConnector(KVConnector):
    source = "peer"

    def __init__(self, transport: KVTransport, kv: KVCacheManager, pool: KVPool, timeout_s: float) -> None:
        self.transport = transport
        self.kv = kv
        self.pool = pool
        self.page_size = kv.page_size
        self.timeout_s = timeout_s
        self._expected: dict[str, Request] = {}  # decode requests promised KV, no load started yet
        self._loads: dict[
            str, tuple[str, KVLoadPart, float]
        ] = {}  # request id -> (transfer id, part, deadline)
        self._load_by_transfer: dict[str, str] = {}
        self._sending: dict[str, tuple[str, list[int]]] = {}  # transfer id -> (request id, held pages)
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
        first_page = part.start_token // self.page_size
        spec = ReceiveSpec(
            transfer.transfer_id,
            first_page,
            list(part.page_ids),
            part.start_token + part.num_tokens,
            prompt_hash(request.prompt_token_ids),
        )
        self._loads[request.request_id] = (transfer.transfer_id, part, time.monotonic() + self.timeout_s)
        self._load_by_transfer[transfer.transfer_id] = request.request_id
        self.transport.open_receive(spec)

    def poll(self) -> list[KVLoadResult]:
        results, self._results = self._results, []
        for event in self.transport.events():
            if event.kind == "received":
                request_id = self._load_by_transfer.pop(event.transfer_id, None)
                if request_id is None:
                    continue
                _, part, _ = self._loads.pop(request_id)
                if event.ok:
                    self.num_pages_received += event.num_pages
                else:
                    self.num_receive_failures += 1
                    logger.warning(
                        "KV transfer %s failed (%s); request %s recomputes its prompt",
                        event.transfer_id,
                        event.detail,
                        request_id,
                    )
                results.append(KVLoadResult(request_id, "peer", part.num_tokens if event.ok else 0))
            else:
                entry = self._sending.pop(event.transfer_id, None)
                if entry is None:
                    continue
                request_id, pages = entry
                self.kv.release_pages(pages)  # the sender is done reading them
                self._sending_requests.discard(request_id)
                self._sent.append((request_id, event.ok))
                if event.ok:
                    self.num_pages_sent += event.num_pages
                else:
                    self.num_send_failures += 1
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
                    self.transport.close_receive(request.kv_transfer.transfer_id)
        return results

    def _end_load(self, request_id: str) -> None:
        entry = self._loads.pop(request_id, None)
        if entry is not None:
            self._load_by_transfer.pop(entry[0], None)
            self.transport.close_receive(entry[0])  # no write lands after this returns

    def cancel(self, request_id: str) -> None:
        self._end_load(request_id)

    # ---- both -----------------------------------------------------------------------------------

    def request_finished(self, request: Request) -> None:
        transfer = request.kv_transfer
        if transfer is None:
            return
        if transfer.role == "decode":
            self._expected.pop(request.request_id, None)
            self._end_load(request.request_id)
            self.transport.close_receive(transfer.transfer_id)  # a sender that comes later is told no
            return
        if transfer.role != "prefill" or not transfer.peer:
            return
        # Aborted or failed: send nothing, but tell the decode side at once (it recomputes).
        complete = request.finish_reason in ("stop", "length")
        num_tokens = min(request.num_computed_tokens, request.num_prompt_tokens) if complete else 0
        pages = list(request.page_ids[: -(-num_tokens // self.page_size)])
        self.kv.hold_pages(pages)
        self._sending[transfer.transfer_id] = (request.request_id, pages)
        self._sending_requests.add(request.request_id)
        self.transport.send(
            SendSpec(
                transfer.transfer_id,
                transfer.peer,
                PoolPageSource(self.pool, pages),
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
        return self.transport.wakeup_fd

    def counters(self) -> dict[str, int]:
        return {
            "transfer_failures": self.num_receive_failures + self.num_send_failures,
            "transfer_pages_received": self.num_pages_received,
            "transfer_pages_sent": self.num_pages_sent,
        }

    def close(self) -> None:
        self.transport.close()
