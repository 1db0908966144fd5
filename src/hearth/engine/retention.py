"""Tool-pause retention: the KV pages of an agent session's last turn stay resident while the agent waits on a
tool, so the next turn finds its prefix in the cache instead of recomputing it.

Between turns a session's pages are only parked in the prefix cache, first in line for eviction under memory
pressure. Retention holds an extra reference on them (`KVCacheManager.hold_pages`, as a PD send does) for
`ttl_s` after the turn ends; the next turn of the session replaces the hold with its own pages, and a hold
that expires is released (the pages become parked again, evictable as usual). Caps bound what is held: per
tenant (the prefix root, which covers `cache_salt` / the API key's tenant) and in total, so one tenant's
sessions cannot pin the cache against the others; past a cap the tenant's (or anyone's) oldest hold goes first.
Holds never cost a request its pages: when the scheduler cannot allocate, holds are given up, oldest first,
before any request waits or is preempted (`yield_oldest`), so retention only decides which *parked* pages the
cache keeps.

Plain Python, scheduler-side: `retain` when a request finishes, `expire` once per step.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol


class PageKeeper(Protocol):
    def hold_pages(self, page_ids: list[int]) -> None: ...

    def release_pages(self, page_ids: list[int]) -> None: ...


class RetainedRequest(Protocol):
    page_ids: list[int]
    cached_page_count: int
    prefix_root: bytes


@dataclass
class _Hold:
    tenant: bytes
    page_ids: list[int]
    expires_s: float


@dataclass
class RetentionStats:
    retained_pages: int = 0  # held now
    retained_sessions: int = 0
    retained_total: int = 0  # holds taken
    expired_total: int = 0  # holds released at their TTL
    evicted_total: int = 0  # holds released early by a cap
    replaced_total: int = 0  # holds replaced by the session's next turn (the retention paid off or was moot)
    yielded_total: int = 0  # holds released because requests needed the pages


@dataclass
class SessionRetention:
    kv: PageKeeper
    ttl_s: float
    max_pages: int  # in total
    max_pages_per_tenant: int
    clock: Callable[[], float] = time.monotonic
    stats: RetentionStats = field(default_factory=RetentionStats)
    _holds: OrderedDict[str, _Hold] = field(default_factory=OrderedDict)  # oldest first
    _tenant_pages: dict[bytes, int] = field(default_factory=dict)

    def retain(self, session: str, request: RetainedRequest) -> None:
        """Hold the finished request's cached pages for its session (replacing the session's previous hold)."""
        pages = list(request.page_ids[: request.cached_page_count])
        key = f"{request.prefix_root.hex()}:{session}"  # a session name never crosses tenants
        tenant = request.prefix_root
        if not pages or len(pages) > min(self.max_pages, self.max_pages_per_tenant):
            self._release(key, "replaced")
            return
        self.kv.hold_pages(pages)  # before the old hold goes, so pages both turns share never park
        if self._release(key, "replaced"):
            self.stats.replaced_total += 1
        self._holds[key] = _Hold(tenant, pages, self.clock() + self.ttl_s)
        self._tenant_pages[tenant] = self._tenant_pages.get(tenant, 0) + len(pages)
        self.stats.retained_pages += len(pages)
        self.stats.retained_total += 1
        while self._tenant_pages[tenant] > self.max_pages_per_tenant:
            self._evict_oldest(tenant)
        while self.stats.retained_pages > self.max_pages:
            self._evict_oldest(None)
        self.stats.retained_sessions = len(self._holds)

    def expire(self) -> None:
        """Release the holds whose TTL has passed; cheap when none has."""
        now = self.clock()
        # Holds are kept in the order they were taken, with one TTL: the first unexpired one ends the scan.
        while self._holds:
            key, hold = next(iter(self._holds.items()))
            if hold.expires_s > now:
                break
            self._release(key, "expired")
            self.stats.expired_total += 1
        self.stats.retained_sessions = len(self._holds)

    def yield_oldest(self) -> bool:
        """Release the oldest hold because a running or waiting request needs pages; False when none is left."""
        if not self._holds:
            return False
        self._release(next(iter(self._holds)), "yielded")
        self.stats.yielded_total += 1
        self.stats.retained_sessions = len(self._holds)
        return True

    def release_all(self) -> None:
        for key in list(self._holds):
            self._release(key, "evicted")
        self.stats.retained_sessions = 0

    def _evict_oldest(self, tenant: bytes | None) -> None:
        key = next(k for k, hold in self._holds.items() if tenant is None or hold.tenant == tenant)
        self._release(key, "evicted")
        self.stats.evicted_total += 1

    def _release(self, key: str, reason: str) -> bool:
        hold = self._holds.pop(key, None)
        if hold is None:
            return False
        self.kv.release_pages(hold.page_ids)
        self._tenant_pages[hold.tenant] -= len(hold.page_ids)
        if not self._tenant_pages[hold.tenant]:
            del self._tenant_pages[hold.tenant]
        self.stats.retained_pages -= len(hold.page_ids)
        return True
