"""The tiers' scheduler half (source "tier"): prefetch on a lower-tier hit, write-back when a request ends,
spill on eviction. It decides; every rank's `KVWorker` reads and writes its own shard.

A load is done when every rank answered; what arrived is the fewest leading pages any rank loaded (a rank
whose tier lost a page makes the rest recompute on all ranks: KV must be whole on every rank).
Lookups (is a prefix below the device?) ask rank 0's own tiers, in this process: a hint, since the
loads' merge is what decides.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from hearth.contracts.kv_ops import CancelLoad, KVEvent, TierLoad, TierSave, TierSpill
from hearth.engine.kv_connector import KVConnector, KVLoadPart, KVLoadResult, KVOpQueue, RankEvents
from hearth.engine.request import Request
from hearth.kv.tiers import TierStats

# Engine stats go out with every step's outputs; tier counters are snapshotted at most this often.
STATS_INTERVAL_S = 0.25


class TierConnector(KVConnector):
    source = "tier"

    def __init__(
        self,
        ops: KVOpQueue,
        page_size: int,
        world_size: int,
        lookup: Callable[[list[bytes]], int],
        stats: Callable[[], list[TierStats]],
    ) -> None:
        self.ops = ops
        self.page_size = page_size
        self.lookup = lookup
        self._stats_of = stats
        self._loads = RankEvents(world_size)
        self._results: list[KVLoadResult] = []
        self._stats: list[TierStats] = []
        self._stats_at_s = float("-inf")

    def start_load(self, part: KVLoadPart) -> None:
        self._loads.expect(part.request_id)
        self.ops.add(TierLoad(part.request_id, list(part.keys), list(part.page_ids)))

    def on_events(self, events: list[KVEvent]) -> None:
        for event in events:
            if event.kind != "loaded":
                continue
            answers = self._loads.add(event.request_id, event)
            if answers is not None:
                num_pages = min(a.num_pages if a.ok else 0 for a in answers)
                num_store_pages = min(num_pages, min(a.num_store_pages for a in answers))
                self._results.append(
                    KVLoadResult(
                        event.request_id, "tier", num_pages * self.page_size, num_store_pages * self.page_size
                    )
                )

    def poll(self) -> list[KVLoadResult]:
        results, self._results = self._results, []
        return results

    @property
    def in_flight(self) -> bool:
        return bool(len(self._loads))

    def cancel(self, request_id: str) -> None:
        if request_id in self._loads:
            self._loads.forget(request_id)
            self.ops.add(CancelLoad(request_id))  # runs before any step that could reuse its pages

    def on_evict(self, key: bytes, page_id: int) -> None:
        """The KV manager is about to reuse a cached page: the workers copy it out before the next forward."""
        self.ops.add(TierSpill(key, page_id))

    def request_finished(self, request: Request) -> None:
        num_pages = request.cached_page_count  # full pages whose KV is computed (or loaded) and intact
        if num_pages:
            self.ops.add(TierSave(request.page_keys[:num_pages], request.page_ids[:num_pages]))

    def tier_stats(self) -> list[TierStats]:
        """Rank 0's tiers (every rank's hold their own shards of the same pages)."""
        now = time.monotonic()
        if now - self._stats_at_s >= STATS_INTERVAL_S:
            self._stats, self._stats_at_s = self._stats_of(), now
        return self._stats
