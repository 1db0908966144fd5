"""The router's Prometheus metrics, in a registry of its own.

In-flight tokens are read from the pool when scraped rather than pushed on every request, so the
request path pays nothing for them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hearth.router.workers import WorkerPool

# Router-added latency is sub-millisecond when healthy; the buckets resolve that range.
LATENCY_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 1.0)


class _PoolCollector(Collector):
    def __init__(self, pool: WorkerPool) -> None:
        self._pool = pool

    def collect(self) -> Iterator[Metric]:
        prefill = GaugeMetricFamily(
            "hearth_router_inflight_prefill_tokens",
            "uncached prompt tokens before first token",
            labels=["worker"],
        )
        decode = GaugeMetricFamily(
            "hearth_router_inflight_decode_tokens", "context tokens of streaming requests", labels=["worker"]
        )
        requests = GaugeMetricFamily(
            "hearth_router_inflight_requests", "requests in flight", labels=["worker"]
        )
        healthy = GaugeMetricFamily(
            "hearth_router_worker_healthy", "1 if the worker passes health checks", labels=["worker"]
        )
        for worker in list(self._pool.workers.values()):
            prefill.add_metric([worker.url], worker.load.effective_prefill_tokens())
            decode.add_metric([worker.url], worker.load.effective_decode_tokens())
            requests.add_metric([worker.url], worker.load.requests)
            healthy.add_metric([worker.url], 1.0 if worker.healthy else 0.0)
        yield from (prefill, decode, requests, healthy)


class RouterMetrics:
    def __init__(self, pool: WorkerPool) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "hearth_router_requests", "requests sent to a worker", ["worker"], registry=self.registry
        )
        self.errors = Counter(
            "hearth_router_errors",
            "failed requests by worker and kind",
            ["worker", "kind"],
            registry=self.registry,
        )
        self.decisions = Counter(
            "hearth_router_decisions", "routing decisions by reason", ["reason"], registry=self.registry
        )
        self.retries = Counter(
            "hearth_router_retries", "requests retried on another worker", registry=self.registry
        )
        self.added_latency = Histogram(
            "hearth_router_added_latency_seconds",
            "time from request received to request sent upstream",
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.registry.register(_PoolCollector(pool))
        self._request_children: dict[str, Any] = {}
        self._decision_children: dict[str, Any] = {}

    def request_sent(self, worker_url: str) -> None:
        # labels() takes a lock and builds a key each call; the request path keeps its children.
        child = self._request_children.get(worker_url)
        if child is None:
            child = self._request_children[worker_url] = self.requests.labels(worker_url)
        child.inc()

    def decided(self, reason: str) -> None:
        child = self._decision_children.get(reason)
        if child is None:
            child = self._decision_children[reason] = self.decisions.labels(reason)
        child.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
