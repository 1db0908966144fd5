"""KV from elsewhere: WAITING_FOR_KV (PD receive, lower tier), the eviction callback, the lookup hook.

A fake lower tier in plain Python: `on_evict` copies a page's tokens out of a dict that stands in for
the device pool, `lookup` counts leading keys it holds, and a loader copies pages back in.
"""

from __future__ import annotations

from collections.abc import Sequence

from hearth.engine.request import Request, RequestStatus
from hearth.engine.sampling_params import SamplingParams
from hearth.engine.scheduler import KVLoad, ScheduledRequest, Scheduler
from hearth.kv.manager import KVCacheManager
from hearth.kv.prefix_keys import page_keys, root_key

ROOT = root_key("m")
PAGE = 4


def make_request(index: int, prompt: list[int] | int, max_tokens: int = 8) -> Request:
    tokens = prompt if isinstance(prompt, list) else [index * 1000 + i for i in range(prompt)]
    return Request(
        request_id=f"r{index}",
        prompt_token_ids=tokens,
        params=SamplingParams(max_tokens=max_tokens),
        prefix_root=ROOT,
        arrival_index=index,
        max_model_len=1000,
    )


class Pool:
    """The device pool as slot -> token; the 'worker' writes each row's tokens."""

    def __init__(self) -> None:
        self.slots: dict[int, int] = {}

    @staticmethod
    def slot(request: Request, position: int) -> int:
        return request.page_ids[position // PAGE] * PAGE + position % PAGE

    def page(self, page_id: int) -> list[int | None]:
        return [self.slots.get(page_id * PAGE + i) for i in range(PAGE)]

    def run(self, scheduler: Scheduler, out) -> None:
        for item in out.scheduled:
            request = item.request
            start = request.num_computed_tokens
            for position in range(start):  # the context holds the right KV
                assert self.slots[self.slot(request, position)] == request.token_ids[position]
            for position in range(start, start + item.num_new_tokens):
                self.slots[self.slot(request, position)] = request.token_ids[position]
        scheduler.update(out.scheduled, [[7] if item.samples else [] for item in out.scheduled])


class FakeTier:
    """A lower tier: pages copied out on eviction, found by key, loaded back into the pool."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.pages: dict[bytes, list[int | None]] = {}
        self.evicted: list[tuple[bytes, int]] = []
        self.lookups: list[list[bytes]] = []

    def on_evict(self, key: bytes, page_id: int) -> None:
        self.evicted.append((key, page_id))
        self.pages[key] = self.pool.page(page_id)

    def lookup(self, keys: Sequence[bytes]) -> int:
        self.lookups.append(list(keys))
        found = 0
        for key in keys:
            if key not in self.pages:
                break
            found += 1
        return found

    def load(self, load: KVLoad) -> None:
        for key, page_id in zip(load.keys, load.page_ids):
            for offset, token in enumerate(self.pages[key]):
                self.pool.slots[page_id * PAGE + offset] = token


def run_to_completion(scheduler: Scheduler, pool: Pool, requests: list[Request], max_tokens: int = 2) -> None:
    for _ in range(100):
        if not any(r.status in (RequestStatus.WAITING, RequestStatus.RUNNING) for r in requests):
            return
        pool.run(scheduler, scheduler.schedule())
        for request in list(scheduler.running):
            if request in requests and len(request.output_token_ids) >= max_tokens:
                scheduler.finish(request)
    raise AssertionError("requests did not finish")


def assert_no_leaks(scheduler: Scheduler) -> None:
    for request in [*scheduler.running, *scheduler.waiting, *scheduler.waiting_for_kv.values()]:
        scheduler.finish(request)
    kv = scheduler.kv
    assert not scheduler.has_work
    assert all(count == 0 for count in kv.allocator.ref_counts)
    assert kv.num_used_pages == 0


def new_scheduler(num_pages: int = 32, tier: FakeTier | None = None, **kwargs) -> Scheduler:
    kv = KVCacheManager(
        num_pages,
        PAGE,
        on_evict=tier.on_evict if tier else None,
        lookup=tier.lookup if tier else None,
    )
    return Scheduler(kv, **{"max_num_batched_tokens": 64, "max_num_seqs": 8} | kwargs)


# ---- PD receive ---------------------------------------------------------------------------------


def test_pd_request_waits_for_its_kv_then_computes_only_the_last_token():
    scheduler = new_scheduler()
    request = make_request(0, 10)
    scheduler.add(request, kv_pending_tokens=10)
    out = scheduler.schedule()
    assert out.scheduled == [] and request.status is RequestStatus.WAITING_FOR_KV
    (load,) = out.kv_loads
    # One prompt token is always computed here: its logits pick the first token.
    assert (load.request, load.start_token, load.num_tokens, load.num_tier_tokens) == (request, 0, 9, 0)
    assert load.page_ids == request.page_ids and len(load.page_ids) == 3 and load.keys == []
    assert load.page_generations == request.page_generations
    assert scheduler.has_work and scheduler.schedule().scheduled == []  # parked until the KV arrives
    assert scheduler.kv_arrived(request, 9)
    assert request.status is RequestStatus.RUNNING and request.num_computed_tokens == 9
    assert request.cached_tokens == 0  # a peer's KV is not a cache hit
    assert request.cached_tokens_by_source == (0, 0, 0, 9)  # usage still says where it came from
    assert request.cached_page_count == 2  # the arrived full pages are now in the prefix cache
    out = scheduler.schedule()
    assert [(s.request, s.num_new_tokens, s.samples) for s in out.scheduled] == [(request, 1, True)]
    assert not scheduler.kv_arrived(request, 0)  # not waiting any more
    assert_no_leaks(scheduler)


def test_pd_transfer_shrinks_by_the_receivers_own_prefix_hit():
    scheduler, pool = new_scheduler(), Pool()
    shared = list(range(100, 108))
    first = make_request(0, shared + [1, 2])
    scheduler.add(first)
    run_to_completion(scheduler, pool, [first])
    request = make_request(1, shared + [3, 4, 5, 6])
    scheduler.add(request, kv_pending_tokens=12)
    (load,) = scheduler.schedule().kv_loads
    assert (load.start_token, load.num_tokens) == (8, 3)  # only the missing tokens move
    assert load.page_ids == request.page_ids[2:]
    scheduler.kv_arrived(request, 3)
    assert request.cached_tokens == 8 and request.num_computed_tokens == 11
    assert_no_leaks(scheduler)


def test_pd_request_whose_prompt_is_cached_here_needs_no_transfer():
    scheduler, pool = new_scheduler(), Pool()
    first = make_request(0, list(range(100, 109)))
    scheduler.add(first)
    run_to_completion(scheduler, pool, [first])
    request = make_request(1, list(range(100, 109)))
    scheduler.add(request, kv_pending_tokens=9)
    out = scheduler.schedule()
    assert out.kv_loads == [] and [(s.request, s.num_new_tokens) for s in out.scheduled] == [(request, 1)]
    scheduler.update(out.scheduled, [[7]])
    scheduler._preempt(scheduler.running.pop())
    scheduler.kv.reset_prefix_cache()
    out = scheduler.schedule()  # the peer is not asked twice: recompute
    assert out.kv_loads == [] and [s.num_new_tokens for s in out.scheduled] == [10]
    assert_no_leaks(scheduler)


def test_failed_load_recomputes_in_the_pages_already_held():
    scheduler, pool = new_scheduler(), Pool()
    request = make_request(0, 10)
    scheduler.add(request, kv_pending_tokens=10)
    out = scheduler.schedule()
    held = list(request.page_ids)
    assert scheduler.kv_failed(request)
    assert request.status is RequestStatus.RUNNING and request.num_computed_tokens == 0
    assert request.page_ids == held and request.cached_tokens == 0
    assert (scheduler.num_kv_load_failures, scheduler.num_kv_recomputed_tokens) == (1, 9)
    out = scheduler.schedule()
    assert [s.num_new_tokens for s in out.scheduled] == [10] and request.page_ids == held
    pool.run(scheduler, out)
    assert request.output_token_ids == [7]
    assert not scheduler.kv_failed(request)
    assert_no_leaks(scheduler)


def test_partial_arrival_recomputes_the_rest():
    scheduler = new_scheduler()
    request = make_request(0, 10)
    scheduler.add(request, kv_pending_tokens=10)
    scheduler.schedule()
    scheduler.kv_arrived(request, 4)
    assert request.num_computed_tokens == 4 and scheduler.num_kv_recomputed_tokens == 5
    assert [s.num_new_tokens for s in scheduler.schedule().scheduled] == [6]
    assert_no_leaks(scheduler)


def test_abort_while_waiting_for_kv_frees_everything():
    scheduler = new_scheduler()
    request = make_request(0, 10)
    scheduler.add(request, kv_pending_tokens=10)
    scheduler.schedule()
    assert scheduler.kv.num_used_pages == 3
    scheduler.finish(request)
    assert request.status is RequestStatus.FINISHED and request.page_ids == []
    assert scheduler.waiting_for_kv == {} and not scheduler.has_work
    assert not scheduler.kv_arrived(request, 9)  # a late arrival is ignored
    assert_no_leaks(scheduler)


def test_waiting_for_kv_holds_a_seat_and_other_requests_keep_running():
    scheduler = new_scheduler(max_num_seqs=2)
    pd, plain, third = make_request(0, 10), make_request(1, 3), make_request(2, 3)
    scheduler.add(pd, kv_pending_tokens=10)
    scheduler.add(plain)
    scheduler.add(third)
    out = scheduler.schedule()
    assert [s.request for s in out.scheduled] == [plain] and len(out.kv_loads) == 1
    assert list(scheduler.waiting) == [third]  # two seats: pd's and plain's
    assert_no_leaks(scheduler)


def test_no_pages_for_the_load_means_wait_holding_nothing():
    scheduler = new_scheduler(num_pages=2)
    request = make_request(0, 12)
    scheduler.add(request, kv_pending_tokens=12)
    out = scheduler.schedule()
    assert out.kv_loads == [] and list(scheduler.waiting) == [request] and request.page_ids == []
    assert scheduler.kv.num_used_pages == 0
    assert_no_leaks(scheduler)


def test_after_a_preemption_the_request_recomputes_instead_of_waiting_again():
    scheduler = new_scheduler(num_pages=4)
    request = make_request(0, 6)
    scheduler.add(request, kv_pending_tokens=6)
    scheduler.schedule()
    scheduler.kv_arrived(request, 5)
    scheduler.schedule()
    scheduler._preempt(scheduler.running.pop())  # as the running loop does under page pressure
    out = scheduler.schedule()
    # no second load; the arrived full page was cached, so only the rest is recomputed
    assert out.kv_loads == [] and [s.num_new_tokens for s in out.scheduled] == [2]
    assert_no_leaks(scheduler)


# ---- eviction callback and the lower tier ------------------------------------------------------


def test_eviction_callback_sees_each_page_with_its_key_before_reuse():
    pool = Pool()
    tier = FakeTier(pool)
    scheduler = new_scheduler(num_pages=3, tier=tier)
    first = make_request(0, 9)
    scheduler.add(first)
    run_to_completion(scheduler, pool, [first], max_tokens=1)
    keys = page_keys(ROOT, first.token_ids, PAGE)  # 2 full pages are cached
    pages = {key: scheduler.kv.prefix_cache.match([key])[0] for key in keys}
    generations = {page: scheduler.kv.allocator.generations[page] for page in pages.values()}

    def on_evict(key: bytes, page_id: int) -> None:
        # Still the cached page's contents: not handed out yet.
        assert scheduler.kv.allocator.generations[page_id] == generations[page_id]
        assert scheduler.kv.allocator.ref_counts[page_id] == 0
        tier.on_evict(key, page_id)

    scheduler.kv.on_evict = on_evict
    other = make_request(1, 10)
    scheduler.add(other)
    scheduler.schedule()
    # first's tail page is evicted before its head (LRU), each with its own key
    assert tier.evicted == [(keys[1], pages[keys[1]]), (keys[0], pages[keys[0]])]
    assert tier.pages[keys[0]] == first.token_ids[:4] and tier.pages[keys[1]] == first.token_ids[4:8]
    assert_no_leaks(scheduler)


def test_lower_tier_hit_waits_for_kv_then_runs_with_cached_tokens_counted():
    pool = Pool()
    tier = FakeTier(pool)
    scheduler = new_scheduler(num_pages=4, tier=tier)
    prompt = list(range(200, 213))  # 13 tokens: 3 full pages
    first = make_request(0, list(prompt))
    scheduler.add(first)
    run_to_completion(scheduler, pool, [first], max_tokens=1)
    filler = make_request(1, 15)  # needs all 4 pages: every cached page of `first` is spilled
    scheduler.add(filler)
    run_to_completion(scheduler, pool, [filler], max_tokens=1)
    keys = page_keys(ROOT, prompt, PAGE)
    assert set(keys) <= set(tier.pages) and scheduler.kv.prefix_cache.match(keys) == []

    again = make_request(2, prompt + [1, 2, 3])
    scheduler.add(again)
    out = scheduler.schedule()
    assert tier.lookups[-1] == page_keys(ROOT, again.token_ids, PAGE)[:3]  # past the device miss
    assert out.scheduled == [] and again.status is RequestStatus.WAITING_FOR_KV
    (load,) = out.kv_loads
    assert (load.start_token, load.num_tokens, load.num_tier_tokens) == (0, 12, 12)
    assert load.keys == keys and load.page_ids == again.page_ids
    tier.load(load)
    assert scheduler.kv_arrived(again, load.num_tokens)
    assert again.cached_tokens == 12 and again.num_computed_tokens == 12
    assert again.cached_tokens_by_source == (0, 12, 0, 0)
    out = scheduler.schedule()
    assert [s.num_new_tokens for s in out.scheduled] == [4]
    pool.run(scheduler, out)  # the pool check: the loaded context holds the prompt's tokens
    scheduler.finish(again)
    # The loaded pages are back in the device cache: the next request hits on the device.
    fourth = make_request(3, list(prompt))
    scheduler.add(fourth)
    lookups = len(tier.lookups)
    out = scheduler.schedule()
    assert out.kv_loads == [] and fourth.cached_tokens == 12 and len(tier.lookups) == lookups
    assert fourth.cached_tokens_by_source == (12, 0, 0, 0)
    assert_no_leaks(scheduler)


def test_lower_tier_partial_hit_after_a_device_hit_and_failure_falls_back():
    pool = Pool()
    tier = FakeTier(pool)
    scheduler = new_scheduler(num_pages=16, tier=tier)
    prompt = list(range(300, 317))  # 4 full pages
    keys = page_keys(ROOT, prompt, PAGE)
    tier.pages[keys[1]] = prompt[4:8]
    tier.pages[keys[2]] = prompt[8:12]
    head = make_request(0, prompt[:5])  # puts page 0 on the device
    scheduler.add(head)
    run_to_completion(scheduler, pool, [head], max_tokens=1)
    request = make_request(1, list(prompt))
    scheduler.add(request)
    (load,) = scheduler.schedule().kv_loads
    assert (load.start_token, load.num_tokens, load.keys) == (4, 8, keys[1:3])
    assert scheduler.kv_failed(request)  # e.g. the store timed out
    assert request.cached_tokens == 4 and request.num_computed_tokens == 4
    assert request.cached_tokens_by_source == (4, 0, 0, 0)  # the device hit, nothing from the failed load
    run_to_completion(scheduler, pool, [request], max_tokens=1)
    assert_no_leaks(scheduler)


def test_lookup_leaves_the_last_prompt_token_to_compute():
    pool = Pool()
    tier = FakeTier(pool)
    scheduler = new_scheduler(tier=tier)
    prompt = list(range(400, 408))  # exactly 2 pages
    for i, key in enumerate(page_keys(ROOT, prompt, PAGE)):
        tier.pages[key] = prompt[i * PAGE : (i + 1) * PAGE]
    request = make_request(0, list(prompt))
    scheduler.add(request)
    (load,) = scheduler.schedule().kv_loads
    assert load.num_tokens == 4 and len(tier.lookups[-1]) == 1
    assert_no_leaks(scheduler)


def test_scheduled_rows_of_a_loaded_request_are_plain_rows():
    scheduler = new_scheduler()
    request = make_request(0, 6)
    scheduler.add(request, kv_pending_tokens=6)
    scheduler.schedule()
    scheduler.kv_arrived(request, 5)
    (item,) = scheduler.schedule().scheduled
    assert isinstance(item, ScheduledRequest) and item.draft_token_ids == [] and item.samples
    assert_no_leaks(scheduler)
