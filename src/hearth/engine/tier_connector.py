"""The KV connector of the cache tiers (source "tier"): prefetch on a lower-tier hit, write-back when a
request ends. A thin adapter: the work (threads, tiers, timeouts) is `hearth.kv.tiers.TierStack`'s."""

from __future__ import annotations

import time

from hearth.engine.kv_connector import KVConnector, KVLoadPart, KVLoadResult
from hearth.engine.request import Request
from hearth.kv.tiers import TierStack, TierStats

# Engine stats go out with every step's outputs; tier counters are snapshotted at most this often.
STATS_INTERVAL_S = 0.25


class TierConnector(KVConnector):
    source = "tier"

    def __init__(self, stack: TierStack, page_size: int) -> None:
        self.stack = stack
        self.page_size = page_size
        self._started: set[str] = set()
        self._stats: list[TierStats] = []
        self._stats_at_s = float("-inf")

    def start_load(self, part: KVLoadPart) -> None:
        self._started.add(part.request_id)
        self.stack.start_load(part.request_id, part.keys, part.page_ids)

    def poll(self) -> list[KVLoadResult]:
        results = []
        for request_id, num_pages, num_store_pages in self.stack.poll_by_source():
            if request_id in self._started:
                self._started.discard(request_id)
                results.append(
                    KVLoadResult(
                        request_id, "tier", num_pages * self.page_size, num_store_pages * self.page_size
                    )
                )
        return results

    def cancel(self, request_id: str) -> None:
        self._started.discard(request_id)
        self.stack.cancel(request_id)  # the pool is written only in poll(): nothing lands after this

    def request_finished(self, request: Request) -> None:
        num_pages = request.cached_page_count  # full pages whose KV is computed (or loaded) and intact
        if num_pages:
            self.stack.write_back(request.page_keys[:num_pages], request.page_ids[:num_pages])

    def tier_stats(self) -> list[TierStats]:
        now = time.monotonic()
        if now - self._stats_at_s >= STATS_INTERVAL_S:
            self._stats, self._stats_at_s = self.stack.stats(), now
        return self._stats

    def close(self) -> None:
        self.stack.close()
