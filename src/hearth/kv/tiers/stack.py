"""The tier stack: every tier below the device, with the threads that keep their I/O off the engine's path.

Who runs what:
- engine thread: `lookup` (local tiers from memory; a remote store in one short round trip), `on_evict`
  (copy the page out while its KV is intact: into host RAM, or queued for the tiers below),
  `write_back` (a finished request's pages, queued), `poll` (loaded pages into the pool), `cancel`.
- loader thread: reads the pages of each started load, tier by tier (host, disk, store), and hands
  them to `poll`. The pool is only ever written on the engine thread, so a cancelled load can never
  land: `cancel` just forgets it.
- writer thread: encodes and stores queued pages. The queue is bounded: when a store is slow or down,
  new writes are dropped (and counted), never waited for.

A tier that raises `TierUnavailable` is skipped for `retry_after_s` (lookups say 0, writes are dropped,
loads recompute), then tried again, so writes resume once it is back. A load that takes longer than
`load_timeout_s` is answered "nothing arrived" (recompute) and its late pages are thrown away.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from hearth.kv.tiers.base import KVTier, Page, TierUnavailable
from hearth.kv.tiers.host import HostTier
from hearth.kv.tiers.stats import TierStats

logger = logging.getLogger("hearth.kv.tiers")


class PagePool(Protocol):
    """What the stack needs of a pool's pages (`hearth.kv.page_io.PageIO`): page-major reads and writes."""

    def read(self, page_ids: list[int], device: torch.device | str = "cpu") -> torch.Tensor: ...

    def write(self, page_ids: list[int], data: torch.Tensor) -> None: ...


@dataclass
class _Load:
    request_id: str
    keys: list[bytes]
    page_ids: list[int]
    started_s: float
    cancelled: bool = False
    pages: list[Page] = field(default_factory=list)
    num_store_pages: int = 0  # of `pages`, those a shared store (a tier that is not local) served


@dataclass(frozen=True)
class _Write:
    key: bytes
    page: Page
    targets: tuple[KVTier, ...]


_STOP = object()


class TierStack:
    def __init__(
        self,
        tiers: Sequence[KVTier],
        pool: PagePool,
        write_queue_bytes: int = 256 << 20,
        load_timeout_s: float = 5.0,
        retry_after_s: float = 2.0,
    ) -> None:
        if not tiers:
            raise ValueError("a tier stack needs at least one tier")
        self.tiers = list(tiers)
        self.pool = pool
        self.host = next((t for t in self.tiers if isinstance(t, HostTier)), None)
        self.below_host = [t for t in self.tiers if t is not self.host]
        self.load_timeout_s = load_timeout_s
        self.retry_after_s = retry_after_s
        page_bytes = self.tiers[0].spec.page_bytes
        self._writes: queue.Queue[_Write | object] = queue.Queue(
            maxsize=max(16, write_queue_bytes // page_bytes)
        )
        self._queued: set[bytes] = set()  # keys waiting in the write queue (no double writes)
        self._queued_lock = threading.Lock()
        self._down_until: dict[str, float] = {}
        self._loads: queue.Queue[_Load | object] = queue.Queue()
        self._inflight: dict[str, _Load] = {}
        self._done: deque[_Load] = deque()
        self._closed = False
        self._writer = threading.Thread(target=self._write_loop, name="hearth-kv-tier-writer", daemon=True)
        self._loader = threading.Thread(target=self._load_loop, name="hearth-kv-tier-loader", daemon=True)
        self._writer.start()
        self._loader.start()

    # ---- tier health ------------------------------------------------------------------------------

    def _is_down(self, tier: KVTier) -> bool:
        until = self._down_until.get(tier.name)
        if until is None:
            return False
        if time.monotonic() >= until:
            self._down_until.pop(tier.name, None)  # the loader and writer threads may both get here
            logger.info("KV tier %s: trying again", tier.name)
            return False
        return True

    def _went_down(self, tier: KVTier, exc: Exception) -> None:
        if tier.name not in self._down_until:
            logger.warning(
                "KV tier %s unavailable (%s); skipping it for %.1f s", tier.name, exc, self.retry_after_s
            )
        self._down_until[tier.name] = time.monotonic() + self.retry_after_s
        tier.unavailable()

    # ---- engine thread ----------------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading keys some tier holds (each page may come from a different tier)."""
        found, asked_remote = 0, set()
        while found < len(keys):
            for tier in self.tiers:
                if (not tier.local and tier.name in asked_remote) or self._is_down(tier):
                    continue
                rest = keys[found:]
                try:
                    held = tier.lookup(rest)
                except TierUnavailable as exc:
                    self._went_down(tier, exc)
                    continue
                if not tier.local:
                    asked_remote.add(tier.name)
                tier.stats.add(lookup_pages=len(rest), lookup_hit_pages=held)
                if held:
                    found += held
                    break
            else:
                break
        return found

    def on_evict(self, key: bytes, page_id: int) -> None:
        """A cached device page is about to be reused: copy it into host RAM, or queue it for the tiers below."""
        targets = self._targets(
            key, self.below_host if self.host is None else [t for t in self.below_host if not t.local]
        )
        if self.host is None and not targets:
            return
        page = self._read([page_id])[0]
        if self.host is not None:
            for spilled_key, spilled_page in self.host.put([(key, page)]):
                self._enqueue(
                    spilled_key,
                    spilled_page,
                    self._targets(spilled_key, [t for t in self.below_host if t.local]),
                )
            self.host.stats.add(written_pages=1, written_bytes=self.host.spec.page_bytes)
        if targets:
            self._enqueue(key, page, targets)

    def write_back(self, keys: Sequence[bytes], page_ids: Sequence[int]) -> None:
        """A request ended: queue its full pages for every tier below the host that lacks them (the
        device keeps them cached; host RAM gets them only on eviction)."""
        wanted = [
            (key, page_id, targets)
            for key, page_id in zip(keys, page_ids)
            if (targets := self._targets(key, self.below_host))
        ]
        if not wanted:
            return
        pages = self._read([page_id for _, page_id, _ in wanted])
        for (key, _, targets), page in zip(wanted, pages, strict=True):
            self._enqueue(key, page, targets)

    def _targets(self, key: bytes, tiers: Sequence[KVTier]) -> tuple[KVTier, ...]:
        with self._queued_lock:
            if key in self._queued:
                return ()
        return tuple(t for t in tiers if not t.knows(key))

    def _read(self, page_ids: list[int]) -> list[Page]:
        # A copy: these pages stay valid after the device page is reused.
        return list(self.pool.read(page_ids).unbind(0))

    def _enqueue(self, key: bytes, page: Page, targets: tuple[KVTier, ...]) -> None:
        if not targets:
            return
        live = tuple(t for t in targets if not self._is_down(t))
        for tier in targets:
            if tier not in live:
                tier.stats.add(dropped_writes=1)
        if not live:
            return
        try:
            self._writes.put_nowait(_Write(key, page, live))
        except queue.Full:
            for tier in live:
                tier.stats.add(dropped_writes=1)
            return
        with self._queued_lock:
            self._queued.add(key)

    def start_load(self, request_id: str, keys: Sequence[bytes], page_ids: Sequence[int]) -> None:
        load = _Load(request_id, list(keys), list(page_ids), time.monotonic())
        self._inflight[request_id] = load
        self._loads.put(load)

    def poll(self) -> list[tuple[str, int]]:
        """(request id, leading pages now in the pool) for each load that ended since the last call."""
        return [(request_id, num_pages) for request_id, num_pages, _ in self.poll_by_source()]

    def poll_by_source(self) -> list[tuple[str, int, int]]:
        """As `poll`, with how many of those pages came from a shared store (usage reports it apart)."""
        answers: list[tuple[str, int, int]] = []
        while self._done:
            load = self._done.popleft()
            if load.cancelled or self._inflight.get(load.request_id) is not load:
                continue  # cancelled or timed out: its pages may belong to someone else by now
            del self._inflight[load.request_id]
            count = len(load.pages)
            if count:
                self.pool.write(load.page_ids[:count], torch.stack(load.pages))
            answers.append((load.request_id, count, load.num_store_pages))
        if self._inflight:
            now = time.monotonic()
            for load in [ld for ld in self._inflight.values() if now - ld.started_s > self.load_timeout_s]:
                load.cancelled = True
                del self._inflight[load.request_id]
                logger.warning(
                    "KV tier load for %s timed out after %.1f s; recomputing",
                    load.request_id,
                    self.load_timeout_s,
                )
                answers.append((load.request_id, 0, 0))
        return answers

    def cancel(self, request_id: str) -> None:
        load = self._inflight.pop(request_id, None)
        if load is not None:
            load.cancelled = True

    @property
    def num_loads_in_flight(self) -> int:
        return len(self._inflight)

    def stats(self) -> list[TierStats]:
        return [tier.snapshot() for tier in self.tiers]

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until queued writes are done (tests, shutdown); True if they all were."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._writes.unfinished_tasks == 0:
                return True
            time.sleep(0.005)
        return False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.flush(timeout_s=2.0)
        self._loads.put(_STOP)
        try:
            self._writes.put_nowait(_STOP)
        except queue.Full:
            pass
        self._loader.join(timeout=2.0)
        self._writer.join(timeout=2.0)
        for tier in self.tiers:
            tier.close()

    # ---- loader thread ----------------------------------------------------------------------------

    def _load_loop(self) -> None:
        while True:
            load = self._loads.get()
            if load is _STOP:
                return
            assert isinstance(load, _Load)
            if not load.cancelled:
                try:
                    load.pages, load.num_store_pages = self._fetch(load.keys)
                except Exception:  # a bug in a tier must not kill the thread; the request recomputes
                    logger.exception("KV tier load failed")
                    load.pages = []
            self._done.append(load)

    def _fetch(self, keys: list[bytes]) -> tuple[list[Page], int]:
        """The leading pages of `keys` any tier has, and how many of them a shared store served."""
        pages: list[Page] = []
        num_store_pages = 0
        while len(pages) < len(keys):
            for tier in self.tiers:
                if self._is_down(tier):
                    continue
                started = time.perf_counter()
                try:
                    got = tier.load(keys[len(pages) :])
                except TierUnavailable as exc:
                    tier.stats.add(failed_reads=1)
                    self._went_down(tier, exc)
                    continue
                tier.stats.read_took(time.perf_counter() - started)
                if got:
                    tier.stats.add(hit_pages=len(got), hit_bytes=len(got) * tier.spec.page_bytes)
                    pages.extend(got)
                    if not tier.local:
                        num_store_pages += len(got)
                    break
            else:
                break
        return pages, num_store_pages

    # ---- writer thread ----------------------------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            first = self._writes.get()
            batch = [first]
            while len(batch) < 64:  # a batch per round trip for network stores
                try:
                    batch.append(self._writes.get_nowait())
                except queue.Empty:
                    break
            try:
                self._write_batch([w for w in batch if isinstance(w, _Write)])
            finally:
                with self._queued_lock:
                    for write in batch:
                        if isinstance(write, _Write):
                            self._queued.discard(write.key)
                for _ in batch:
                    self._writes.task_done()
            if any(w is _STOP for w in batch):
                return

    def _write_batch(self, batch: list[_Write]) -> None:
        by_tier: dict[str, tuple[KVTier, list[tuple[bytes, Page]]]] = {}
        for write in batch:
            for tier in write.targets:
                by_tier.setdefault(tier.name, (tier, []))[1].append((write.key, write.page))
        for tier, items in by_tier.values():
            if self._is_down(tier):
                tier.stats.add(dropped_writes=len(items))
                continue
            started = time.perf_counter()
            try:
                tier.store(items)
            except TierUnavailable as exc:
                tier.stats.add(failed_writes=len(items))
                self._went_down(tier, exc)
                continue
            except Exception:
                logger.exception("KV tier %s: write failed", tier.name)
                tier.stats.add(failed_writes=len(items))
                continue
            tier.stats.write_took(time.perf_counter() - started)
            tier.stats.add(written_pages=len(items), written_bytes=len(items) * tier.spec.page_bytes)
