"""Per-tier counters and latency histograms, kept by the tier stack and sent with the engine's stats.

Plain counters (no prometheus here: the engine core has no HTTP); the API process turns them into
`/metrics` families. Histograms are cumulative bucket counts, Prometheus style.
"""

from __future__ import annotations

import bisect
import threading

import msgspec

# Seconds; a host hit is ~1e-4 s a page, a disk or network store ~1e-3..1e-1 s for a batch.
LATENCY_BUCKETS_S = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
)


class LatencyHistogram(msgspec.Struct):
    """Counts per upper bound of `LATENCY_BUCKETS_S` (non-cumulative; the last is +Inf) and the sum."""

    counts: list[int] = msgspec.field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_S) + 1))
    sum_s: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS_S, seconds)] += 1
        self.sum_s += seconds

    @property
    def count(self) -> int:
        return sum(self.counts)


class TierStats(msgspec.Struct):
    """One tier's traffic. Pages and bytes count what moved; `hit_pages` are pages a load got from this
    tier; `dropped_writes` were never attempted (queue full, tier down); `failed_writes`/`failed_reads`
    raised; `invalid_pages` were read back and rejected (damaged, wrong layout or key)."""

    name: str
    lookup_pages: int = 0
    lookup_hit_pages: int = 0
    hit_pages: int = 0
    hit_bytes: int = 0
    written_pages: int = 0
    written_bytes: int = 0
    dropped_writes: int = 0
    failed_writes: int = 0
    failed_reads: int = 0
    invalid_pages: int = 0
    stored_pages: int = 0  # gauge: pages this process knows the tier holds (-1: not known, a shared store)
    stored_bytes: int = 0
    read_latency: LatencyHistogram = msgspec.field(default_factory=LatencyHistogram)
    write_latency: LatencyHistogram = msgspec.field(default_factory=LatencyHistogram)


class TierStatsRecorder:
    """Thread-safe updates of one tier's stats (the engine thread, the loader and the writer all count)."""

    def __init__(self, name: str) -> None:
        self._stats = TierStats(name)
        self._lock = threading.Lock()

    def add(self, **counts: int) -> None:
        with self._lock:
            for field_name, amount in counts.items():
                setattr(self._stats, field_name, getattr(self._stats, field_name) + amount)

    def read_took(self, seconds: float) -> None:
        with self._lock:
            self._stats.read_latency.observe(seconds)

    def write_took(self, seconds: float) -> None:
        with self._lock:
            self._stats.write_latency.observe(seconds)

    def snapshot(self, stored_pages: int, stored_bytes: int) -> TierStats:
        with self._lock:
            copy = msgspec.structs.replace(
                self._stats,
                stored_pages=stored_pages,
                stored_bytes=stored_bytes,
                read_latency=LatencyHistogram(
                    list(self._stats.read_latency.counts), self._stats.read_latency.sum_s
                ),
                write_latency=LatencyHistogram(
                    list(self._stats.write_latency.counts), self._stats.write_latency.sum_s
                ),
            )
        return copy
