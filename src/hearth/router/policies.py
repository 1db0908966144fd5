"""Placement policies, chosen by name with `--policy`.

Every policy sees the same thing: the request's estimated prompt tokens, its prefix keys and its
session key, and the healthy workers with their loads and prefix indexes. It returns one worker
and a reason (the reason is a metric label, so it is a short fixed word).
"""

from __future__ import annotations

import bisect
import hashlib
import random
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from hearth.contracts.registry import Registry
from hearth.router.workers import Worker


@dataclass(frozen=True)
class BalanceConfig:
    """When is a worker too loaded to win on affinity or prefix?

    Overloaded means both: more than `abs_tokens` above the least loaded worker, and more than
    `rel` times the mean load (loads counted in in-flight tokens, this request included).
    """

    rel: float = 1.5
    abs_tokens: int = 8192
    # A prefix shorter than this is not worth leaving the least loaded worker for.
    min_prefix_match_tokens: int = 256
    virtual_nodes: int = 64
    seed: int = 0


@dataclass
class RouteRequest:
    prompt_tokens: int
    block_keys: list[bytes] = field(default_factory=list)
    tokens_per_key: int = 64
    session_key: str | None = None


@dataclass
class Decision:
    worker: Worker
    reason: str
    matched_tokens: int = 0


class RoutingPolicy(ABC):
    """Picks one worker for a request.

    Contract: `workers` is non-empty and holds only healthy workers of the wanted role;
    `choose` returns one of them and must not change any load or index (the router records
    the placement afterwards). Deterministic given the same state, except `random`.
    """

    name: str

    def __init__(self, config: BalanceConfig) -> None:
        self.config = config

    @abstractmethod
    def choose(self, request: RouteRequest, workers: Sequence[Worker]) -> Decision: ...


POLICIES: Registry[type[RoutingPolicy]] = Registry("routing policy")


def register_policy(name: str) -> Callable[[type[RoutingPolicy]], type[RoutingPolicy]]:
    """Class decorator: `--policy NAME` routes with this class (which then knows its name)."""

    def wrap(cls: type[RoutingPolicy]) -> type[RoutingPolicy]:
        cls.name = name
        return POLICIES.register(name)(cls)

    return wrap


def make_policy(name: str, config: BalanceConfig | None = None) -> RoutingPolicy:
    """A new policy; an UnknownNameError (a ValueError) naming the known ones for an unknown `name`."""
    return POLICIES.get(name)(config or BalanceConfig())


def is_overloaded(
    worker: Worker, workers: Sequence[Worker], request_tokens: int, config: BalanceConfig, now_s: float
) -> bool:
    loads = [w.load.total_tokens(now_s) for w in workers]
    load = worker.load.total_tokens(now_s) + request_tokens
    mean = (sum(loads) + request_tokens) / len(loads)
    return load - min(loads) > config.abs_tokens and load > config.rel * mean


@register_policy("round_robin")
class RoundRobinPolicy(RoutingPolicy):
    def __init__(self, config: BalanceConfig) -> None:
        super().__init__(config)
        self._next = 0

    def choose(self, request: RouteRequest, workers: Sequence[Worker]) -> Decision:
        worker = workers[self._next % len(workers)]
        self._next += 1
        return Decision(worker, "round_robin")


@register_policy("random")
class RandomPolicy(RoutingPolicy):
    def __init__(self, config: BalanceConfig) -> None:
        super().__init__(config)
        self._rng = random.Random(config.seed)

    def choose(self, request: RouteRequest, workers: Sequence[Worker]) -> Decision:
        return Decision(self._rng.choice(workers), "random")


@register_policy("token_aware")
class TokenAwarePolicy(RoutingPolicy):
    """Least in-flight tokens; ties broken by in-flight requests, then in rotation."""

    def __init__(self, config: BalanceConfig) -> None:
        super().__init__(config)
        self._rotation = 0

    def choose(self, request: RouteRequest, workers: Sequence[Worker]) -> Decision:
        return Decision(self.least_loaded(workers, time.monotonic()), "least_tokens")

    def least_loaded(self, workers: Sequence[Worker], now_s: float) -> Worker:
        n = len(workers)
        self._rotation = (self._rotation + 1) % n
        best = workers[self._rotation]
        best_key = (best.load.total_tokens(now_s), best.load.requests)
        for i in range(1, n):
            worker = workers[(self._rotation + i) % n]
            key = (worker.load.total_tokens(now_s), worker.load.requests)
            if key < best_key:
                best, best_key = worker, key
        return best


class HashRing:
    """Consistent hashing: each worker owns `virtual_nodes` points; a key goes to the next point."""

    def __init__(self, urls: Sequence[str], virtual_nodes: int) -> None:
        points = [(_hash64(f"{url}#{i}"), url) for url in urls for i in range(virtual_nodes)]
        points.sort()
        self._hashes = [h for h, _ in points]
        self._urls = [u for _, u in points]

    def owner(self, key: str) -> str:
        i = bisect.bisect(self._hashes, _hash64(key)) % len(self._hashes)
        return self._urls[i]


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


class _RingCache:
    def __init__(self, virtual_nodes: int) -> None:
        self._virtual_nodes = virtual_nodes
        self._urls: tuple[str, ...] = ()
        self._ring: HashRing | None = None

    def owner(self, key: str, workers: Sequence[Worker]) -> Worker:
        urls = tuple(sorted(w.url for w in workers))
        if self._ring is None or urls != self._urls:
            self._urls, self._ring = urls, HashRing(urls, self._virtual_nodes)
        url = self._ring.owner(key)
        return next(w for w in workers if w.url == url)


@register_policy("consistent_hash")
class ConsistentHashPolicy(RoutingPolicy):
    """The baseline: the session header through a hash ring, with no load bound; round robin without it."""

    def __init__(self, config: BalanceConfig) -> None:
        super().__init__(config)
        self._ring = _RingCache(config.virtual_nodes)
        self._fallback = RoundRobinPolicy(config)

    def choose(self, request: RouteRequest, workers: Sequence[Worker]) -> Decision:
        if request.session_key is None:
            return self._fallback.choose(request, workers)
        return Decision(self._ring.owner(request.session_key, workers), "hash")


@register_policy("session_affinity")
class SessionAffinityPolicy(RoutingPolicy):
    """`x-session-affinity` -> its ring owner while not overloaded; else least tokens."""

    def __init__(self, config: BalanceConfig) -> None:
        super().__init__(config)
        self._ring = _RingCache(config.virtual_nodes)
        self._tokens = TokenAwarePolicy(config)

    def choose(self, request: RouteRequest, workers: Sequence[Worker]) -> Decision:
        now_s = time.monotonic()
        if request.session_key is None:
            return Decision(self._tokens.least_loaded(workers, now_s), "least_tokens")
        owner = self._ring.owner(request.session_key, workers)
        # The owner only has to compute what it does not hold already.
        cached_tokens = owner.prefix.match_blocks(request.block_keys) * request.tokens_per_key
        uncached_tokens = max(0, request.prompt_tokens - cached_tokens)
        if is_overloaded(owner, workers, uncached_tokens, self.config, now_s):
            return Decision(self._tokens.least_loaded(workers, now_s), "affinity_spill")
        return Decision(owner, "affinity")


@register_policy("prefix_aware")
class PrefixAwarePolicy(RoutingPolicy):
    """The worker holding the longest prefix wins, unless that would overload it."""

    def __init__(self, config: BalanceConfig) -> None:
        super().__init__(config)
        self._tokens = TokenAwarePolicy(config)

    def choose(self, request: RouteRequest, workers: Sequence[Worker]) -> Decision:
        now_s = time.monotonic()
        best: Worker | None = None
        best_blocks = 0
        best_load = 0
        for worker in workers:
            blocks = worker.prefix.match_blocks(request.block_keys)
            if blocks == 0 or blocks < best_blocks:
                continue
            load = worker.load.total_tokens(now_s)
            if blocks > best_blocks or load < best_load:
                best, best_blocks, best_load = worker, blocks, load
        matched_tokens = min(best_blocks * request.tokens_per_key, request.prompt_tokens)
        if best is None or matched_tokens < self.config.min_prefix_match_tokens:
            return Decision(self._tokens.least_loaded(workers, now_s), "least_tokens")
        uncached_tokens = request.prompt_tokens - matched_tokens
        if is_overloaded(best, workers, uncached_tokens, self.config, now_s):
            return Decision(self._tokens.least_loaded(workers, now_s), "prefix_spill")
        return Decision(best, "prefix", matched_tokens)


@register_policy("default")
class DefaultPolicy(RoutingPolicy):
    """Affinity when the client names a session, else the longest cached prefix, else least tokens.

    The session's ring owner keeps it while it holds at least as long a prefix as anyone else;
    once a session has moved (its owner was overloaded), the prefix decides where it continues.
    """

    def __init__(self, config: BalanceConfig) -> None:
        super().__init__(config)
        self._affinity = SessionAffinityPolicy(config)
        self._prefix = PrefixAwarePolicy(config)

    def choose(self, request: RouteRequest, workers: Sequence[Worker]) -> Decision:
        if request.session_key is None:
            return self._prefix.choose(request, workers)
        decision = self._affinity.choose(request, workers)
        if decision.reason != "affinity" or not request.block_keys:
            return decision
        owner_blocks = decision.worker.prefix.match_blocks(request.block_keys)
        if owner_blocks == len(request.block_keys):
            return decision
        best_blocks = max(w.prefix.match_blocks(request.block_keys) for w in workers)
        if best_blocks > owner_blocks:
            return self._prefix.choose(request, workers)
        return decision
