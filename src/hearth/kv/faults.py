"""Fault injection for the KV integrity tests: `HEARTH_KV_FAULTS="early_free:0.01,table_swap:0.005"`.

With the given probability per page allocation (seeded: `HEARTH_KV_FAULTS_SEED`, else the engine's seed,
so a run is repeatable):
- `early_free` hands a page that a running request still uses back to the head of the free list, as a
  reference-counting bug would; the next allocation gives it to someone else and its tag changes, while
  every earlier holder still lists it (and the prefix cache may still name it).
- `table_swap` swaps two entries of a running request's page table (the expected tags stay with their
  logical positions, so each entry now names a page carrying another page's tag).

Unset, the KV cache manager holds None and pays one attribute test per allocation.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hearth.kv.manager import KVCacheManager, PageHolder

FAULTS_ENV = "HEARTH_KV_FAULTS"
SEED_ENV = "HEARTH_KV_FAULTS_SEED"
FAULT_KINDS = ("early_free", "table_swap")


def parse_faults(spec: str) -> dict[str, float]:
    """`"early_free:0.01,table_swap:0.005"` -> {kind: probability per allocation}."""
    probabilities: dict[str, float] = {}
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        kind, sep, value = part.partition(":")
        if kind not in FAULT_KINDS or not sep:
            raise ValueError(
                f"{FAULTS_ENV}: {part!r} is not KIND:PROBABILITY with KIND in {', '.join(FAULT_KINDS)}"
            )
        probability = float(value)
        if not 0.0 <= probability <= 1.0:
            raise ValueError(f"{FAULTS_ENV}: the probability of {kind} must be in [0, 1], got {probability}")
        probabilities[kind] = probability
    return probabilities


@dataclass
class InjectedFault:
    """One fault: its kind, the physical pages it touched, and the requests that listed them then."""

    kind: str
    page_ids: tuple[int, ...]
    request_ids: tuple[str, ...]


@dataclass
class KVFaultInjector:
    """Rolls each fault once per page allocation (`after_allocation`, called by the KV cache manager).

    `victims` returns the requests a fault may hit (the scheduler's running requests: those whose next
    step reads their pages). `injected` records every fault, for the campaign's accounting.
    """

    probabilities: dict[str, float]
    seed: int = 0
    victims: Callable[[], Sequence[PageHolder]] = lambda: ()
    injected: list[InjectedFault] = field(default_factory=list)
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    @classmethod
    def from_env(cls, default_seed: int, environ: Mapping[str, str] | None = None) -> KVFaultInjector | None:
        env = os.environ if environ is None else environ
        spec = env.get(FAULTS_ENV, "")
        probabilities = parse_faults(spec)
        if not any(probabilities.values()):
            return None
        return cls(probabilities, seed=int(env.get(SEED_ENV, default_seed)))

    def counts(self) -> dict[str, int]:
        totals = dict.fromkeys(self.probabilities, 0)
        for fault in self.injected:
            totals[fault.kind] += 1
        return totals

    def after_allocation(self, kv: KVCacheManager) -> None:
        rng = self._rng
        for kind, probability in self.probabilities.items():
            if rng.random() < probability:
                fault = self._early_free(kv) if kind == "early_free" else self._table_swap()
                if fault is not None:
                    self.injected.append(fault)

    def _early_free(self, kv: KVCacheManager) -> InjectedFault | None:
        running = self.victims()
        candidates = [holder for holder in running if holder.page_ids]
        if not candidates:
            return None
        victim = self._rng.choice(candidates)
        index = self._rng.randrange(len(victim.page_ids))
        page_id = victim.page_ids[index]
        allocator = kv.allocator
        if (
            allocator.ref_counts[page_id] == 0
            or allocator.generations[page_id] != victim.page_generations[index]
        ):
            return None  # already freed or reused by an earlier fault
        tag = allocator.generations[page_id]
        holders = [
            _request_id(holder)
            for holder in running
            if any(p == page_id and t == tag for p, t in zip(holder.page_ids, holder.page_generations))
        ]
        allocator.reclaim(page_id)
        return InjectedFault("early_free", (page_id,), tuple(holders))

    def _table_swap(self) -> InjectedFault | None:
        candidates = [holder for holder in self.victims() if len(set(holder.page_ids)) >= 2]
        if not candidates:
            return None
        victim = self._rng.choice(candidates)
        pages = victim.page_ids
        while True:
            i, j = self._rng.sample(range(len(pages)), 2)
            if pages[i] != pages[j]:
                break
        pages[i], pages[j] = pages[j], pages[i]
        return InjectedFault("table_swap", (pages[i], pages[j]), (_request_id(victim),))


def _request_id(holder: Any) -> str:
    return str(getattr(holder, "request_id", id(holder)))
