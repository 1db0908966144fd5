"""Workers, their load model, and the pool the router picks from.

Load model (DESIGN "Router load model"): per worker, in-flight prefill tokens (uncached prompt
tokens of requests not yet past their first token) and decode tokens (context of requests still
streaming). Both come from the router's own traffic; a worker's `GET /load` report, when it
offers one, corrects them for traffic the router did not see (other routers, direct clients).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from hearth.router.prefix_index import PrefixIndex
from hearth.router.upstream import Origin

ROLES = ("mixed", "prefill", "decode")
# A report older than this no longer describes the worker; fall back to the router's own counts.
REPORT_TTL_S = 3.0


@dataclass
class LoadReport:
    """A worker's `GET /load` answer, and the router's own counts at the moment it arrived."""

    prefill_tokens: int
    decode_tokens: int
    running_requests: int
    waiting_requests: int
    kv_pages_used: int
    kv_pages_total: int
    own_prefill_tokens: int
    own_decode_tokens: int
    received_at_s: float

    @classmethod
    def from_json(cls, data: dict[str, Any], own_prefill: int, own_decode: int) -> LoadReport:
        def _int(name: str) -> int:
            value = data.get(name, 0)
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"load report field {name!r} must be a non-negative number")
            return int(value)

        return cls(
            prefill_tokens=_int("prefill_tokens"),
            decode_tokens=_int("decode_tokens"),
            running_requests=_int("running_requests"),
            waiting_requests=_int("waiting_requests"),
            kv_pages_used=_int("kv_pages_used"),
            kv_pages_total=_int("kv_pages_total"),
            own_prefill_tokens=own_prefill,
            own_decode_tokens=own_decode,
            received_at_s=time.monotonic(),
        )


@dataclass
class Ticket:
    """One request's share of a worker's load, released exactly once."""

    worker: Worker
    prefill_tokens: int
    context_tokens: int
    past_first_token: bool = False
    done: bool = False


class WorkerLoad:
    def __init__(self) -> None:
        self.prefill_tokens = 0
        self.decode_tokens = 0
        self.requests = 0
        self.report: LoadReport | None = None

    def _correction(self, own: int, reported: int, own_at_report: int) -> int:
        # What the worker carries beyond what the router sent it, carried forward onto the
        # router's live count until the next report.
        return max(0, own + reported - own_at_report)

    def effective_prefill_tokens(self, now_s: float | None = None) -> int:
        report = self.report
        if report is None or (now_s or time.monotonic()) - report.received_at_s > REPORT_TTL_S:
            return self.prefill_tokens
        return self._correction(self.prefill_tokens, report.prefill_tokens, report.own_prefill_tokens)

    def effective_decode_tokens(self, now_s: float | None = None) -> int:
        report = self.report
        if report is None or (now_s or time.monotonic()) - report.received_at_s > REPORT_TTL_S:
            return self.decode_tokens
        return self._correction(self.decode_tokens, report.decode_tokens, report.own_decode_tokens)

    def total_tokens(self, now_s: float | None = None) -> int:
        return self.effective_prefill_tokens(now_s) + self.effective_decode_tokens(now_s)


class Worker:
    def __init__(
        self, url: str, role: str = "mixed", bootstrap_port: int | None = None, prefix_blocks: int = 65536
    ) -> None:
        if role not in ROLES:
            raise ValueError(f"worker role must be one of {ROLES}, got {role!r}")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"worker URL must start with http:// or https://, got {url!r}")
        self.url = url.rstrip("/")
        # Parsed once: the request path must not pay for URL parsing.
        self.origin = Origin.from_url(self.url)
        self.role = role
        self.bootstrap_port = bootstrap_port
        self.healthy = True
        self.load = WorkerLoad()
        self.prefix = PrefixIndex(prefix_blocks)
        # None: not asked yet; False: the worker answered 404, so it offers no load report.
        self.offers_load_report: bool | None = None
        # When the worker last answered a proxied request (monotonic seconds).
        self.last_ok_s = 0.0

    def __repr__(self) -> str:
        return f"Worker({self.url!r}, role={self.role!r}, healthy={self.healthy})"

    @property
    def host(self) -> str:
        return self.url.split("://", 1)[1].split("/", 1)[0].rsplit(":", 1)[0]

    # The three transitions of a request on this worker.
    def start(self, prefill_tokens: int, context_tokens: int) -> Ticket:
        self.load.prefill_tokens += prefill_tokens
        self.load.requests += 1
        return Ticket(self, prefill_tokens, context_tokens)

    def first_token(self, ticket: Ticket) -> None:
        if ticket.past_first_token or ticket.done:
            return
        ticket.past_first_token = True
        self.load.prefill_tokens -= ticket.prefill_tokens
        self.load.decode_tokens += ticket.context_tokens

    def finish(self, ticket: Ticket) -> None:
        if ticket.done:
            return
        ticket.done = True
        if ticket.past_first_token:
            self.load.decode_tokens -= ticket.context_tokens
        else:
            self.load.prefill_tokens -= ticket.prefill_tokens
        self.load.requests -= 1

    def describe(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "role": self.role,
            "healthy": self.healthy,
            "bootstrap_port": self.bootstrap_port,
            "in_flight_requests": self.load.requests,
            "prefill_tokens": self.load.effective_prefill_tokens(),
            "decode_tokens": self.load.effective_decode_tokens(),
            "prefix_index_blocks": len(self.prefix),
            "offers_load_report": self.offers_load_report,
        }


@dataclass
class WorkerPool:
    """All workers by URL. `version` changes whenever membership or health changes."""

    prefix_blocks: int = 65536
    workers: dict[str, Worker] = field(default_factory=dict)
    version: int = 0
    _healthy_by_role: dict[str, list[Worker]] = field(default_factory=dict)
    _healthy_version: int = -1

    def add(self, url: str, role: str = "mixed", bootstrap_port: int | None = None) -> Worker:
        worker = Worker(url, role, bootstrap_port, self.prefix_blocks)
        if worker.url in self.workers:
            raise ValueError(f"worker {worker.url} is already in the pool")
        self.workers[worker.url] = worker
        self.version += 1
        return worker

    def remove(self, url: str) -> Worker:
        worker = self.workers.pop(url.rstrip("/"), None)
        if worker is None:
            raise KeyError(f"no worker {url} in the pool")
        worker.healthy = False
        self.version += 1
        return worker

    def set_healthy(self, worker: Worker, healthy: bool) -> bool:
        """Returns True when this changed the worker's state."""
        if worker.healthy == healthy:
            return False
        worker.healthy = healthy
        if healthy:
            # A worker that comes back may have restarted with an empty cache.
            worker.prefix.clear()
            worker.offers_load_report = None
        self.version += 1
        return True

    def healthy(self, role: str) -> list[Worker]:
        """Healthy workers of `role`; the same list object until membership or health changes."""
        if self._healthy_version != self.version:
            self._healthy_by_role = {
                r: [w for w in self.workers.values() if w.role == r and w.healthy] for r in ROLES
            }
            self._healthy_version = self.version
        return self._healthy_by_role[role]

    def has_role(self, role: str) -> bool:
        return any(w.role == role for w in self.workers.values())
