"""Tool-pause retention: a session's pages survive memory pressure between turns, within TTL and caps."""

from __future__ import annotations

from dataclasses import dataclass, field

from hearth.engine.retention import SessionRetention
from hearth.kv.manager import KVCacheManager
from hearth.kv.prefix_keys import root_key

PAGE = 4


@dataclass
class Holder:
    tokens: list[int]
    root: bytes = field(default_factory=lambda: root_key("m"))
    page_ids: list[int] = field(default_factory=list)
    page_generations: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    cached_page_count: int = 0
    page_keys: list[bytes] = field(default_factory=list)

    @property
    def all_token_ids(self) -> list[int]:
        return self.tokens

    @property
    def prefix_root(self) -> bytes:
        return self.root


def _turn(manager: KVCacheManager, holder: Holder) -> int:
    """Compute the holder's tokens (reusing the cache); returns the tokens found cached."""
    cached = manager.match_prefix(holder, len(holder.tokens))
    assert manager.allocate_slots(holder, len(holder.tokens) - holder.num_computed_tokens)
    holder.num_computed_tokens = len(holder.tokens)
    manager.cache_full_pages(holder)
    return cached


def _pressure(manager: KVCacheManager, num_pages: int, start: int) -> None:
    """Other traffic that fills and frees `num_pages` pages, evicting parked pages on the way."""
    other = Holder(list(range(start, start + num_pages * PAGE)))
    _turn(manager, other)
    manager.free(other)


def _session_pages_after_a_pause(retention: SessionRetention | None, manager: KVCacheManager) -> int:
    session = Holder(list(range(8 * PAGE)))
    _turn(manager, session)
    if retention is not None:
        retention.retain("s1", session)
    manager.free(session)
    _pressure(manager, 8, 10_000)  # the tool runs; other sessions use the cache...
    _pressure(manager, 8, 20_000)  # ...and push out the least recently used parked pages
    next_turn = Holder(list(range(8 * PAGE)) + [7, 7, 7, 7])
    return _turn(manager, next_turn) // PAGE


def test_without_retention_the_paused_session_is_evicted() -> None:
    manager = KVCacheManager(num_pages=16, page_size=PAGE)
    assert _session_pages_after_a_pause(None, manager) == 0


def test_with_retention_the_next_turn_finds_its_prefix() -> None:
    manager = KVCacheManager(num_pages=16, page_size=PAGE)
    retention = SessionRetention(manager, ttl_s=60, max_pages=8, max_pages_per_tenant=8)
    # The others' parked pages are evicted instead of the held ones.
    assert _session_pages_after_a_pause(retention, manager) == 8
    assert retention.stats.retained_pages == 8 and retention.stats.retained_sessions == 1


def test_a_hold_expires_and_its_pages_become_evictable_again() -> None:
    now = [0.0]
    manager = KVCacheManager(num_pages=16, page_size=PAGE)
    retention = SessionRetention(
        manager, ttl_s=5, max_pages=16, max_pages_per_tenant=16, clock=lambda: now[0]
    )
    session = Holder(list(range(8 * PAGE)))
    _turn(manager, session)
    retention.retain("s1", session)
    manager.free(session)
    used_while_held = manager.num_used_pages
    now[0] = 5.0
    retention.expire()
    assert retention.stats.expired_total == 1 and retention.stats.retained_pages == 0
    assert manager.num_used_pages == used_while_held - 8  # parked again: evictable
    _pressure(manager, 16, 10_000)
    assert _turn(manager, Holder(list(range(8 * PAGE)))) == 0


def test_the_next_turn_replaces_the_hold_and_shared_pages_stay_resident() -> None:
    manager = KVCacheManager(num_pages=32, page_size=PAGE)
    retention = SessionRetention(manager, ttl_s=60, max_pages=32, max_pages_per_tenant=32)
    first = Holder(list(range(4 * PAGE)))
    _turn(manager, first)
    retention.retain("s1", first)
    manager.free(first)
    second = Holder(list(range(6 * PAGE)))
    assert _turn(manager, second) == 4 * PAGE
    retention.retain("s1", second)
    manager.free(second)
    assert retention.stats.replaced_total == 1
    assert retention.stats.retained_pages == 6 and manager.num_used_pages == 6


def test_one_tenant_cannot_hold_more_than_its_share() -> None:
    manager = KVCacheManager(num_pages=64, page_size=PAGE)
    retention = SessionRetention(manager, ttl_s=60, max_pages=40, max_pages_per_tenant=10)
    greedy, other = root_key("m", "a"), root_key("m", "b")
    for k in range(4):  # four sessions of 4 pages each: only two fit the tenant's 10
        holder = Holder([k * 1000 + t for t in range(4 * PAGE)], root=greedy)
        _turn(manager, holder)
        retention.retain(f"g{k}", holder)
        manager.free(holder)
    polite = Holder(list(range(4 * PAGE)), root=other)
    _turn(manager, polite)
    retention.retain("p", polite)
    manager.free(polite)
    assert retention.stats.evicted_total == 2
    assert retention.stats.retained_pages == 12  # 8 of the greedy tenant's, 4 of the other's
    assert retention.stats.retained_sessions == 3


def test_the_total_cap_evicts_the_oldest_hold() -> None:
    manager = KVCacheManager(num_pages=64, page_size=PAGE)
    retention = SessionRetention(manager, ttl_s=60, max_pages=8, max_pages_per_tenant=8)
    for k in range(3):
        holder = Holder([k * 1000 + t for t in range(4 * PAGE)], root=root_key("m", str(k)))
        _turn(manager, holder)
        retention.retain(f"s{k}", holder)
        manager.free(holder)
    assert retention.stats.retained_pages == 8 and retention.stats.evicted_total == 1
    retention.release_all()
    assert manager.num_used_pages == 0


def test_holds_give_way_to_a_request_that_needs_the_pages() -> None:
    from hearth.engine.scheduler import Scheduler

    manager = KVCacheManager(num_pages=16, page_size=PAGE)
    scheduler = Scheduler(manager, max_num_batched_tokens=1024, max_num_seqs=8)
    retention = scheduler.retention = SessionRetention(
        manager, ttl_s=60, max_pages=12, max_pages_per_tenant=12
    )
    session = Holder(list(range(12 * PAGE)))
    _turn(manager, session)
    retention.retain("s1", session)
    manager.free(session)
    big = Holder(list(range(50_000, 50_000 + 10 * PAGE)))
    assert scheduler._allocate(big, 10 * PAGE)  # type: ignore[arg-type]  (only the page-holder fields are used)
    assert retention.stats.yielded_total == 1 and retention.stats.retained_pages == 0
