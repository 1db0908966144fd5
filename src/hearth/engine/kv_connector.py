"""KV from elsewhere: connectors that fill `WAITING_FOR_KV` requests' pages, and the coordinator that runs them.

The scheduler parks a request whose prompt KV can come from elsewhere and lists a `KVLoad`: the
leading `num_tier_tokens` from a lower cache tier (by page key), the rest from a peer (the prefill
server of PD). The coordinator splits each load into those two parts, hands each to the connector of
its source, polls them every engine step, and, once both parts of a load have answered, tells the
scheduler how many leading tokens arrived (`kv_arrived`); whatever did not arrive is recomputed, so a
failed or slow source costs time, never an error.

Connector contract:
- `start_load(part)` begins filling `part.page_ids` and returns at once (it must not block the step).
- `poll()` returns the parts that finished since the last call, each with how many leading tokens of
  the part are in place (0 = failed). Every started part is answered exactly once, unless cancelled.
- `cancel(request_id)`: the request ended (finished or aborted; unknown ids are ignored); when it
  returns, no write for that request may land in the pool any more (its pages are about to be
  freed and reused).
- `request_finished(request)` runs when a request ends, before its pages are freed: a place for a
  tier's write-back or a PD prefill server's send (the pages' KV is intact during the call).
Connectors are scheduler halves: they decide, and put what must move into the shared `KVOpQueue`; the step
carries those ops to every rank's worker half (`hearth.engine.kv_worker`), whose events come back in the
step's output and are handed to every connector (`on_events`; rank 0 merges the ranks'). `in_flight` says
a connector waits for events (the steps then ask every rank to report).
Optional hooks (PD): `request_added(request)` returns how many leading tokens a peer promised (the
scheduler's `kv_pending_tokens`); a connector still sending a finished request's KV says so in
`is_sending` and reports the outcome once in `poll_sent`, and the engine holds that request's last
output back until then; `wakeup_fd` becomes readable when `poll` has news, so an idle loop can sleep.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Literal

from hearth.contracts.kv_ops import KVEvent, KVOp, KVOps
from hearth.engine.request import Request
from hearth.engine.scheduler import KVLoad, Scheduler

KVSource = Literal["tier", "peer"]


class KVOpQueue:
    """The ops the scheduler halves decided since the last step, in the order they decided them (a page
    spilled before it is reloaded into, a load cancelled before its pages are reused)."""

    def __init__(self) -> None:
        self._ops: list[KVOp] = []

    def add(self, op: KVOp) -> None:
        self._ops.append(op)

    def __bool__(self) -> bool:
        return bool(self._ops)

    def take(self) -> list[KVOp]:
        ops, self._ops = self._ops, []
        return ops


class RankEvents:
    """Rank 0's merge of the ranks' answers to one op: done when every rank answered."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._answers: dict[str, dict[int, KVEvent]] = {}

    def expect(self, key: str) -> None:
        self._answers[key] = {}

    def forget(self, key: str) -> None:
        self._answers.pop(key, None)

    def __contains__(self, key: str) -> bool:
        return key in self._answers

    def __len__(self) -> int:
        return len(self._answers)

    def add(self, key: str, event: KVEvent) -> list[KVEvent] | None:
        """Every rank's event once the last one is in (then the key is forgotten), else None."""
        answers = self._answers.get(key)
        if answers is None:
            return None
        answers[event.rank] = event
        if len(answers) < self.world_size:
            return None
        del self._answers[key]
        return [answers[rank] for rank in sorted(answers)]


@dataclass
class KVLoadPart:
    """Tokens [start_token, start_token + num_tokens) of a request, into `page_ids` (request page
    `start_token // page_size + i` is `page_ids[i]`, with tag `page_generations[i]`); `keys` name the
    pages of a tier part (empty for a peer part)."""

    request: Request
    source: KVSource
    start_token: int
    num_tokens: int
    page_ids: list[int]
    page_generations: list[int]
    keys: list[bytes] = field(default_factory=list)

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass(frozen=True)
class KVLoadResult:
    request_id: str
    source: KVSource
    num_tokens: int  # leading tokens of the part whose KV is in place; 0 = the load failed
    num_store_tokens: int = 0  # of a tier part's `num_tokens`, those a shared store served (usage says so)


class KVConnector(ABC):
    """One source of KV (a tier stack, a PD transport); see the module docstring for the contract."""

    source: KVSource

    @abstractmethod
    def start_load(self, part: KVLoadPart) -> None: ...

    @abstractmethod
    def poll(self) -> list[KVLoadResult]: ...

    @abstractmethod
    def cancel(self, request_id: str) -> None: ...

    def on_events(self, events: list[KVEvent]) -> None:  # noqa: B027 - optional hook
        """The ranks' events of the last step (every connector sees all of them)."""

    @property
    def in_flight(self) -> bool:
        """Waiting for events from the workers."""
        return False

    def request_finished(self, request: Request) -> None:  # noqa: B027 - optional hook
        pass

    def close(self) -> None:  # noqa: B027 - optional hook
        pass

    def request_added(self, request: Request) -> int:
        return 0

    def is_sending(self, request_id: str) -> bool:
        return False

    def poll_sent(self) -> list[tuple[str, bool]]:
        return []

    @property
    def busy(self) -> bool:
        """Work in flight that no scheduled request stands for (a send): the engine loop keeps polling."""
        return False

    @property
    def wakeup_fd(self) -> int | None:
        return None

    def counters(self) -> dict[str, int]:
        return {}


@dataclass
class _Pending:
    load: KVLoad
    tier_tokens: int | None  # None: not answered yet
    peer_tokens: int | None
    store_tokens: int = 0


class KVLoadCoordinator:
    """Runs the connectors for the engine: start loads, collect answers, make requests runnable."""

    def __init__(
        self,
        scheduler: Scheduler,
        connectors: list[KVConnector],
        page_size: int,
        ops: KVOpQueue | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.ops = ops if ops is not None else KVOpQueue()
        self.page_size = page_size
        self.connectors: dict[KVSource, KVConnector] = {}
        for connector in connectors:
            if connector.source in self.connectors:
                raise ValueError(f"two KV connectors for the source {connector.source!r}")
            self.connectors[connector.source] = connector
        self._pending: dict[str, _Pending] = {}

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def take_ops(self) -> KVOps | None:
        """The ops for the next step's workers, or None when there is nothing to do or to hear about."""
        report = any(c.in_flight for c in self.connectors.values())
        if not self.ops and not report:
            return None
        return KVOps(self.ops.take(), report)

    @property
    def has_ops(self) -> bool:
        return bool(self.ops) or any(c.in_flight for c in self.connectors.values())

    def on_events(self, events: list[KVEvent]) -> None:
        if events:
            for connector in self.connectors.values():
                connector.on_events(events)

    def start(self, loads: list[KVLoad]) -> None:
        for load in loads:
            num_tier = load.num_tier_tokens
            num_peer = load.num_tokens - num_tier
            pending = _Pending(load, None if num_tier else 0, None if num_peer else 0)
            self._pending[load.request.request_id] = pending
            tier_pages = num_tier // self.page_size  # tier tokens are whole pages from start_token
            if num_tier:
                self._start(
                    pending,
                    KVLoadPart(
                        load.request,
                        "tier",
                        load.start_token,
                        num_tier,
                        load.page_ids[:tier_pages],
                        load.page_generations[:tier_pages],
                        list(load.keys),
                    ),
                )
            if num_peer:
                self._start(
                    pending,
                    KVLoadPart(
                        load.request,
                        "peer",
                        load.start_token + num_tier,
                        num_peer,
                        load.page_ids[tier_pages:],
                        load.page_generations[tier_pages:],
                    ),
                )
            self._maybe_complete(load.request.request_id)

    def _start(self, pending: _Pending, part: KVLoadPart) -> None:
        connector = self.connectors.get(part.source)
        if connector is None:  # nobody can serve it: recompute those tokens
            self._record(pending, part.source, 0)
            return
        connector.start_load(part)

    def poll(self) -> None:
        """Collect finished parts; requests whose loads are complete become runnable."""
        for connector in self.connectors.values():
            for result in connector.poll():
                pending = self._pending.get(result.request_id)
                if pending is None:
                    continue  # cancelled meanwhile
                self._record(pending, result.source, result.num_tokens)
                if result.source == "tier":
                    pending.store_tokens = result.num_store_tokens
                self._maybe_complete(result.request_id)

    @staticmethod
    def _record(pending: _Pending, source: KVSource, num_tokens: int) -> None:
        if source == "tier":
            pending.tier_tokens = num_tokens
        else:
            pending.peer_tokens = num_tokens

    def _maybe_complete(self, request_id: str) -> None:
        pending = self._pending[request_id]
        if pending.tier_tokens is None or pending.peer_tokens is None:
            return
        del self._pending[request_id]
        load = pending.load
        num_tier = load.num_tier_tokens
        tier_tokens = min(pending.tier_tokens, num_tier)
        # KV must be contiguous: a peer's pages after a gap in the tier's are of no use.
        arrived = (
            tier_tokens
            if tier_tokens < num_tier
            else num_tier + min(pending.peer_tokens, load.num_tokens - num_tier)
        )
        if arrived == 0:
            self.scheduler.kv_failed(load.request)
        else:
            self.scheduler.kv_arrived(load.request, arrived, min(pending.store_tokens, tier_tokens))

    def request_finished(self, request: Request) -> None:
        """Before a request's pages are freed: stop its loads, then let connectors see its KV."""
        if self._pending.pop(request.request_id, None) is not None:
            for connector in self.connectors.values():
                connector.cancel(request.request_id)
        for connector in self.connectors.values():
            connector.request_finished(request)

    def request_added(self, request: Request) -> int:
        """Leading tokens whose KV a connector promised for a new request (0: none)."""
        return max((c.request_added(request) for c in self.connectors.values()), default=0)

    def is_sending(self, request_id: str) -> bool:
        return any(c.is_sending(request_id) for c in self.connectors.values())

    def poll_sent(self) -> list[tuple[str, bool]]:
        return [item for c in self.connectors.values() for item in c.poll_sent()]

    @property
    def busy(self) -> bool:
        return any(c.busy for c in self.connectors.values())

    @property
    def wakeup_fds(self) -> list[int]:
        return [fd for c in self.connectors.values() if (fd := c.wakeup_fd) is not None]

    def counters(self) -> dict[str, int]:
        merged: dict[str, int] = {}
        for connector in self.connectors.values():
            for name, value in connector.counters().items():
                merged[name] = merged.get(name, 0) + value
        return merged

    def close(self) -> None:
        for connector in self.connectors.values():
            connector.close()
