"""Placement policies, the prefix index and the load model: deterministic, no network."""

from __future__ import annotations

import pytest

from hearth.router.policies import (
    POLICIES,
    BalanceConfig,
    HashRing,
    RouteRequest,
    is_overloaded,
    make_policy,
)
from hearth.router.prefix_index import CharBlockKeyer, PrefixIndex, TokenPageKeyer
from hearth.router.workers import Worker, WorkerPool

CONFIG = BalanceConfig(rel=1.5, abs_tokens=1000, min_prefix_match_tokens=32)


def make_workers(n: int) -> list[Worker]:
    pool = WorkerPool(prefix_blocks=1000)
    return [pool.add(f"http://127.0.0.1:{18500 + i}") for i in range(n)]


def keys_for(tokens: list[int], page_size: int = 16) -> list[bytes]:
    return TokenPageKeyer("m", page_size).keys("", tokens, None)


def test_registry_names_every_policy_and_rejects_unknown() -> None:
    assert {"round_robin", "random", "token_aware", "session_affinity", "prefix_aware", "default"} <= set(
        POLICIES
    )
    with pytest.raises(ValueError, match="unknown routing policy 'nope'"):
        make_policy("nope")


def test_round_robin_cycles_through_workers() -> None:
    workers = make_workers(3)
    policy = make_policy("round_robin", CONFIG)
    chosen = [policy.choose(RouteRequest(10), workers).worker.url for _ in range(6)]
    assert chosen == [w.url for w in workers] * 2


def test_random_is_reproducible_with_a_seed_and_uses_every_worker() -> None:
    workers = make_workers(3)
    a = [make_policy("random", CONFIG).choose(RouteRequest(1), workers).worker.url for _ in range(1)]
    b = [make_policy("random", CONFIG).choose(RouteRequest(1), workers).worker.url for _ in range(1)]
    assert a == b
    policy = make_policy("random", CONFIG)
    assert {policy.choose(RouteRequest(1), workers).worker.url for _ in range(60)} == {w.url for w in workers}


def test_token_aware_picks_least_in_flight_tokens() -> None:
    workers = make_workers(3)
    workers[0].start(prefill_tokens=500, context_tokens=500)
    t1 = workers[1].start(prefill_tokens=100, context_tokens=100)
    workers[2].start(prefill_tokens=300, context_tokens=300)
    policy = make_policy("token_aware", CONFIG)
    assert policy.choose(RouteRequest(10), workers).worker is workers[1]
    # Decode tokens count as well: once past its first token, worker 1 holds its context.
    workers[1].first_token(t1)
    workers[1].start(prefill_tokens=400, context_tokens=400)
    assert policy.choose(RouteRequest(10), workers).worker is workers[2]


def test_token_aware_spreads_ties_instead_of_piling_on_one() -> None:
    workers = make_workers(4)
    policy = make_policy("token_aware", CONFIG)
    chosen = {policy.choose(RouteRequest(10), workers).worker.url for _ in range(4)}
    assert len(chosen) == 4


def test_hash_ring_is_stable_and_moves_few_keys_when_a_worker_leaves() -> None:
    urls = [f"http://w{i}" for i in range(5)]
    ring = HashRing(urls, 64)
    owners = {f"s{i}": ring.owner(f"s{i}") for i in range(500)}
    assert owners == {k: HashRing(urls, 64).owner(k) for k in owners}
    assert len(set(owners.values())) == 5
    smaller = HashRing(urls[:-1], 64)
    moved = [k for k, url in owners.items() if url != urls[-1] and smaller.owner(k) != url]
    assert moved == []  # only the departed worker's sessions move


def test_session_affinity_sticks_then_spills_to_least_tokens_when_overloaded() -> None:
    workers = make_workers(3)
    policy = make_policy("session_affinity", CONFIG)
    first = policy.choose(RouteRequest(100, session_key="agent-7"), workers)
    assert first.reason == "affinity"
    for _ in range(5):
        again = policy.choose(RouteRequest(100, session_key="agent-7"), workers)
        assert (again.worker, again.reason) == (first.worker, "affinity")
    first.worker.start(prefill_tokens=5000, context_tokens=5000)
    spilled = policy.choose(RouteRequest(100, session_key="agent-7"), workers)
    assert spilled.reason == "affinity_spill"
    assert spilled.worker is not first.worker


def test_session_affinity_without_header_uses_least_tokens() -> None:
    workers = make_workers(2)
    workers[0].start(prefill_tokens=50, context_tokens=50)
    decision = make_policy("session_affinity", CONFIG).choose(RouteRequest(10), workers)
    assert (decision.worker, decision.reason) == (workers[1], "least_tokens")


def test_overload_needs_both_the_absolute_and_the_relative_margin() -> None:
    workers = make_workers(2)
    workers[0].start(prefill_tokens=900, context_tokens=900)
    # 900 + 10 above an idle worker: relatively huge, absolutely small -> not overloaded.
    assert not is_overloaded(workers[0], workers, 10, CONFIG, 0.0)
    workers[0].start(prefill_tokens=2000, context_tokens=2000)
    assert is_overloaded(workers[0], workers, 10, CONFIG, 0.0)
    workers[1].start(prefill_tokens=2500, context_tokens=2500)
    assert not is_overloaded(workers[0], workers, 10, CONFIG, 0.0)


def test_prefix_aware_prefers_the_longest_cached_prefix() -> None:
    workers = make_workers(3)
    system = list(range(64))
    history = list(range(1000, 1128))
    workers[0].prefix.insert(keys_for(system))
    workers[2].prefix.insert(keys_for(system + history))
    request = RouteRequest(200, keys_for(system + history + [7] * 32), 16)
    decision = make_policy("prefix_aware", CONFIG).choose(request, workers)
    assert (decision.worker, decision.reason, decision.matched_tokens) == (workers[2], "prefix", 192)


def test_prefix_aware_ignores_short_matches_and_spills_when_imbalanced() -> None:
    workers = make_workers(2)
    policy = make_policy("prefix_aware", CONFIG)
    workers[0].prefix.insert(keys_for(list(range(16))))
    workers[1].start(prefill_tokens=10, context_tokens=10)
    short = policy.choose(RouteRequest(64, keys_for(list(range(64))), 16), workers)
    assert short.reason == "least_tokens"  # 16 matched tokens < min_prefix_match_tokens
    long_prefix = list(range(512))
    workers[1].prefix.insert(keys_for(long_prefix))
    workers[1].start(prefill_tokens=5000, context_tokens=5000)
    spilled = policy.choose(RouteRequest(600, keys_for(long_prefix), 16), workers)
    assert (spilled.worker, spilled.reason) == (workers[0], "prefix_spill")


def test_default_uses_affinity_with_header_and_prefix_without() -> None:
    workers = make_workers(3)
    policy = make_policy("default", CONFIG)
    assert policy.choose(RouteRequest(10, session_key="s"), workers).reason == "affinity"
    workers[1].prefix.insert(keys_for(list(range(64))))
    decision = policy.choose(RouteRequest(64, keys_for(list(range(64))), 16), workers)
    assert (decision.worker, decision.reason) == (workers[1], "prefix")
    assert (
        policy.choose(RouteRequest(64, keys_for(list(range(500, 564))), 16), workers).reason == "least_tokens"
    )


def test_prefix_index_is_bounded_and_forgets_least_recently_used() -> None:
    index = PrefixIndex(capacity_blocks=4)
    a, b = keys_for(list(range(32))), keys_for(list(range(100, 132)))
    index.insert(a)
    index.insert(b)
    assert index.match_blocks(a) == 2 and index.match_blocks(b) == 2
    index.insert(a)  # a is now most recent
    index.insert(keys_for(list(range(200, 232))))
    assert len(index) == 4
    assert index.match_blocks(a) == 2
    assert index.match_blocks(b) == 0


def test_prefix_keys_stop_at_the_first_difference_and_respect_the_tenant() -> None:
    keyer = CharBlockKeyer(block_chars=8)
    index = PrefixIndex(100)
    index.insert(keyer.keys("abcdefgh12345678zzzzzzzz", None, None))
    assert index.match_blocks(keyer.keys("abcdefgh12345678yyyyyyyy", None, None)) == 2
    assert index.match_blocks(keyer.keys("abcdefgX12345678zzzzzzzz", None, None)) == 0
    assert index.match_blocks(keyer.keys("abcdefgh12345678zzzzzzzz", None, "tenant-b")) == 0
    # Token keys are the engine's own page keys (hearth.kv.prefix_keys).
    from hearth.kv.prefix_keys import page_keys, root_key

    assert TokenPageKeyer("m", 4).keys("", list(range(9)), None) == page_keys(
        root_key("m", "router", None), list(range(9)), 4
    )


def test_load_report_corrects_the_routers_own_counts() -> None:
    from hearth.router.workers import LoadReport

    worker = make_workers(1)[0]
    worker.start(prefill_tokens=100, context_tokens=100)
    # The worker sees 700 prefill tokens: 600 came from elsewhere.
    worker.load.report = LoadReport.from_json(
        {"prefill_tokens": 700, "decode_tokens": 50, "running_requests": 3, "waiting_requests": 1}, 100, 0
    )
    assert worker.load.effective_prefill_tokens() == 700
    assert worker.load.effective_decode_tokens() == 50
    worker.start(prefill_tokens=40, context_tokens=40)
    assert worker.load.effective_prefill_tokens() == 740
    # A stale report no longer counts.
    worker.load.report.received_at_s -= 10.0
    assert worker.load.effective_prefill_tokens() == 140
    with pytest.raises(ValueError, match="prefill_tokens"):
        LoadReport.from_json({"prefill_tokens": -1}, 0, 0)


def test_ticket_moves_prefill_to_decode_once_and_releases_once() -> None:
    worker = make_workers(1)[0]
    ticket = worker.start(prefill_tokens=30, context_tokens=100)
    assert (worker.load.prefill_tokens, worker.load.decode_tokens, worker.load.requests) == (30, 0, 1)
    worker.first_token(ticket)
    worker.first_token(ticket)
    assert (worker.load.prefill_tokens, worker.load.decode_tokens) == (0, 100)
    worker.finish(ticket)
    worker.finish(ticket)
    assert (worker.load.prefill_tokens, worker.load.decode_tokens, worker.load.requests) == (0, 0, 0)


def test_default_moves_a_session_to_the_worker_holding_its_longer_prefix() -> None:
    workers = make_workers(3)
    policy = make_policy("default", CONFIG)
    history = list(range(256))
    owner = policy.choose(RouteRequest(256, keys_for(history), 16, "agent-1"), workers).worker
    owner.prefix.insert(keys_for(history[:64]))
    other = next(w for w in workers if w is not owner)
    other.prefix.insert(keys_for(history))  # the session spilled here last turn
    decision = policy.choose(RouteRequest(256, keys_for(history), 16, "agent-1"), workers)
    assert (decision.worker, decision.reason) == (other, "prefix")
    # With the owner holding as much as anyone, the header decides.
    owner.prefix.insert(keys_for(history))
    decision = policy.choose(RouteRequest(256, keys_for(history), 16, "agent-1"), workers)
    assert (decision.worker, decision.reason) == (owner, "affinity")
