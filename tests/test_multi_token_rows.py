"""Multi-token rows: drafts scheduled with a decode, `Scheduler.update` with accepted tokens, KV rollback.

Plain Python: a dict stands in for the KV pool (slot -> the token whose KV it holds), so the tests can
check that every position a row reads holds the right token after any mix of acceptances and
rollbacks, and that no page stays in the prefix cache under a key for tokens it doesn't hold.
"""

from __future__ import annotations

import random

import pytest

from hearth.engine.request import Request
from hearth.engine.sampling_params import SamplingParams
from hearth.engine.scheduler import ScheduledRequest, Scheduler
from hearth.kv.manager import KVCacheManager
from hearth.kv.prefix_keys import page_keys, root_key

ROOT = root_key("m")
PAGE = 4


def make_request(index: int, prompt_len: int, max_tokens: int = 64, max_model_len: int = 1000) -> Request:
    return Request(
        request_id=f"r{index}",
        prompt_token_ids=[index * 1000 + i for i in range(prompt_len)],
        params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        prefix_root=ROOT,
        arrival_index=index,
        max_model_len=max_model_len,
    )


def target(request: Request, position: int) -> int:
    """The token the 'model' picks after `position` (deterministic, differs per request)."""
    return 100 + (position * 7 + int(request.request_id[1:]) * 13) % 50


class FakeWorker:
    """Writes each row's tokens into a slot map and samples `target`, keeping the longest accepted run."""

    def __init__(self, page_size: int = PAGE) -> None:
        self.page_size = page_size
        self.slots: dict[int, int] = {}

    def slot(self, request: Request, position: int) -> int:
        return request.page_ids[position // self.page_size] * self.page_size + position % self.page_size

    def execute(self, batch: list[ScheduledRequest]) -> list[list[int]]:
        accepted = []
        for item in batch:
            request, drafts = item.request, item.draft_token_ids
            start = request.num_computed_tokens
            row = request.token_ids[start : start + item.num_new_tokens - len(drafts)] + drafts
            assert len(row) == item.num_new_tokens
            assert len(request.page_ids) * self.page_size >= start + item.num_new_tokens
            for position in range(start):  # the context the row attends to holds the right KV
                assert self.slots[self.slot(request, position)] == request.token_ids[position], position
            for offset, token in enumerate(row):
                self.slots[self.slot(request, start + offset)] = token
            if not item.samples:
                accepted.append([])
                continue
            first = start + item.num_new_tokens - len(drafts) - 1  # position whose logits pick the next token
            kept = []
            for i in range(len(drafts) + 1):
                kept.append(target(request, first + i))
                if i == len(drafts) or kept[-1] != drafts[i]:
                    break
            accepted.append(kept)
        return accepted

    def check_prefix_cache(self, kv: KVCacheManager, names: dict[bytes, list[int]]) -> None:
        """Every cached page holds exactly the tokens its key names."""
        for key, page_id in kv.prefix_cache._page_by_key.items():
            held = [self.slots.get(page_id * self.page_size + i) for i in range(self.page_size)]
            assert held == names[key]


def step(scheduler: Scheduler, worker: FakeWorker) -> list[ScheduledRequest]:
    out = scheduler.schedule()
    scheduler.update(out.scheduled, worker.execute(out.scheduled))
    return out.scheduled


def finish_all_and_check_no_leaks(scheduler: Scheduler) -> None:
    for request in list(scheduler.running) + list(scheduler.waiting):
        scheduler.finish(request)
    kv = scheduler.kv
    assert all(count == 0 for count in kv.allocator.ref_counts)
    assert kv.num_used_pages == 0
    assert kv.allocator.num_free_pages + kv.prefix_cache.num_parked_pages == kv.num_pages


def decoding(prompt_len: int = 6, num_pages: int = 32, **kwargs) -> tuple[Scheduler, FakeWorker, Request]:
    """A scheduler with one request past its prefill (one output token, c = prompt_len)."""
    limits = {"max_num_batched_tokens": 64, "max_num_seqs": 8} | kwargs
    scheduler = Scheduler(KVCacheManager(num_pages, PAGE), **limits)
    worker = FakeWorker()
    request = make_request(0, prompt_len)
    scheduler.add(request)
    step(scheduler, worker)
    assert request.num_computed_tokens == prompt_len and request.num_tokens == prompt_len + 1
    return scheduler, worker, request


def test_drafts_ride_in_the_decode_row_and_all_accepted():
    scheduler, worker, request = decoding()
    drafts = [target(request, 6 + i) for i in range(3)]  # right guesses
    request.draft_token_ids = list(drafts)
    out = scheduler.schedule()
    (item,) = out.scheduled
    assert (item.num_new_tokens, item.draft_token_ids, item.samples) == (4, drafts, True)
    assert len(request.page_ids) == 3  # positions 6..9 need a third page
    scheduler.update(out.scheduled, worker.execute(out.scheduled))
    assert request.output_token_ids[1:] == drafts + [target(request, 9)]
    assert request.num_computed_tokens == 10 and request.num_tokens == 11
    assert request.draft_token_ids == []
    assert request.cached_page_count == 2 and len(request.page_ids) == 3
    assert request.page_keys[:2] == page_keys(ROOT, request.token_ids, PAGE)[:2]
    assert [s.num_new_tokens for s in scheduler.schedule().scheduled] == [1]
    finish_all_and_check_no_leaks(scheduler)


def test_some_drafts_rejected_rolls_back_their_kv_and_pages():
    scheduler, worker, request = decoding()
    request.draft_token_ids = [target(request, 6), 99, 98, 97, 96, 95]  # one right, then wrong
    out = scheduler.schedule()
    assert out.scheduled[0].num_new_tokens == 7 and len(request.page_ids) == 4  # positions 6..12
    dropped = request.page_ids[2:]
    scheduler.update(out.scheduled, worker.execute(out.scheduled))
    # kept: the accepted draft and the model's token after it; KV valid for positions 0..7
    assert request.output_token_ids[1:] == [target(request, 6), target(request, 7)]
    assert request.num_computed_tokens == 8 and len(request.page_ids) == 2
    assert all(scheduler.kv.allocator.ref_counts[p] == 0 for p in dropped)
    assert not any(scheduler.kv.prefix_cache.is_cached(p) for p in dropped)
    assert request.cached_page_count == 2  # the page full of accepted tokens is cached
    finish_all_and_check_no_leaks(scheduler)


def test_no_draft_accepted_keeps_only_the_new_token():
    scheduler, worker, request = decoding(prompt_len=7)  # c = 7: drafts cross into the third page
    request.draft_token_ids = [99, 98]
    out = scheduler.schedule()
    assert len(request.page_ids) == 3
    scheduler.update(out.scheduled, worker.execute(out.scheduled))
    assert request.output_token_ids[1:] == [target(request, 7)]
    assert request.num_computed_tokens == 8 and len(request.page_ids) == 2
    assert request.cached_page_count == 2
    finish_all_and_check_no_leaks(scheduler)


def test_engine_may_keep_fewer_tokens_than_the_worker_accepted():
    # e.g. the second accepted draft was an EOS: the engine cuts the list before update
    scheduler, worker, request = decoding()
    request.draft_token_ids = [target(request, 6 + i) for i in range(3)]
    out = scheduler.schedule()
    accepted = worker.execute(out.scheduled)
    assert len(accepted[0]) == 4
    scheduler.update(out.scheduled, [accepted[0][:2]])
    assert request.num_computed_tokens == 8 and request.num_tokens == 9 and len(request.page_ids) == 2
    step(scheduler, worker)  # continues from position 8, whose KV is rewritten
    finish_all_and_check_no_leaks(scheduler)


@pytest.mark.parametrize("seed", range(6))
def test_random_acceptance_matches_plain_decoding_and_keeps_kv_and_cache_consistent(seed):
    rng = random.Random(seed)
    scheduler = Scheduler(KVCacheManager(48, PAGE), max_num_batched_tokens=24, max_num_seqs=4)
    worker = FakeWorker()
    requests = [make_request(i, rng.randint(3, 13), max_tokens=rng.randint(5, 30)) for i in range(6)]
    for request in requests:
        scheduler.add(request)
    names: dict[bytes, list[int]] = {}
    for _ in range(400):
        if not scheduler.has_work:
            break
        for request in scheduler.running:
            c = request.num_tokens - 1
            good = rng.randint(0, 4)
            request.draft_token_ids = [target(request, c + i) for i in range(good)] + [
                rng.randint(0, 99) for _ in range(rng.randint(0, 3))
            ]
        batch = step(scheduler, worker)
        assert sum(s.num_new_tokens for s in batch) <= 24
        for item in batch:
            request = item.request
            for i, key in enumerate(page_keys(ROOT, request.token_ids, PAGE)):
                names[key] = request.token_ids[i * PAGE : (i + 1) * PAGE]
            assert request.page_keys == page_keys(ROOT, request.token_ids, PAGE)[: len(request.page_keys)]
            if len(request.output_token_ids) >= request.params.max_tokens:
                scheduler.finish(request)
        worker.check_prefix_cache(scheduler.kv, names)
    assert not scheduler.has_work
    for request in requests:
        n, max_tokens = request.num_prompt_tokens, request.params.max_tokens
        assert len(request.output_token_ids) == max_tokens  # drafts never overshoot max_tokens
        assert request.output_token_ids == [target(request, n - 1 + i) for i in range(max_tokens)]
    finish_all_and_check_no_leaks(scheduler)


def test_drafts_take_only_the_budget_left_after_every_running_request():
    scheduler = Scheduler(KVCacheManager(64, PAGE), max_num_batched_tokens=6, max_num_seqs=8)
    worker = FakeWorker()
    a, b, c = make_request(0, 2), make_request(1, 2), make_request(2, 2)
    for request in (a, b, c):
        scheduler.add(request)
    step(scheduler, worker)
    for request in (a, b, c):
        request.draft_token_ids = [1, 2, 3, 4]
    out = scheduler.schedule()
    rows = {s.request.request_id: (s.num_new_tokens, s.draft_token_ids) for s in out.scheduled}
    assert rows == {"r0": (4, [1, 2, 3]), "r1": (1, []), "r2": (1, [])}  # oldest first, decodes never dropped
    assert out.num_tokens == 6
    scheduler.update(out.scheduled, worker.execute(out.scheduled))
    assert b.draft_token_ids == [] and c.draft_token_ids == []  # stale after the step
    finish_all_and_check_no_leaks(scheduler)


def test_drafts_are_dropped_rather_than_preempting_anyone():
    # 3 pages: a (prompt 3) and b (prompt 2) hold one each; a's drafts would need two more pages.
    scheduler = Scheduler(KVCacheManager(3, PAGE), max_num_batched_tokens=64, max_num_seqs=8)
    worker = FakeWorker()
    a, b = make_request(0, 3), make_request(1, 2)
    scheduler.add(a)
    scheduler.add(b)
    step(scheduler, worker)
    a.draft_token_ids = [target(a, 3 + i) for i in range(5)]  # positions 3..8 -> 3 pages
    out = scheduler.schedule()
    assert out.preempted == [] and [s.draft_token_ids for s in out.scheduled] == [[], []]
    scheduler.update(out.scheduled, worker.execute(out.scheduled))
    a.draft_token_ids = [target(a, 4 + i) for i in range(3)]  # positions 4..7: a's second page, the free one
    out = scheduler.schedule()
    assert out.preempted == [] and {len(s.draft_token_ids) for s in out.scheduled} == {0, 3}
    scheduler.update(out.scheduled, worker.execute(out.scheduled))
    assert a.num_computed_tokens == 8
    finish_all_and_check_no_leaks(scheduler)


def test_drafts_never_pass_max_tokens_or_max_model_len():
    scheduler = Scheduler(KVCacheManager(64, PAGE), max_num_batched_tokens=64, max_num_seqs=8)
    worker = FakeWorker()
    by_tokens = make_request(0, 5, max_tokens=4)  # may still output 3 -> at most 2 drafts
    by_length = make_request(1, 5, max_tokens=None, max_model_len=8)  # 3 outputs -> at most 1 draft
    for request in (by_tokens, by_length):
        scheduler.add(request)
    step(scheduler, worker)
    for request in (by_tokens, by_length):
        request.draft_token_ids = [target(request, 5 + i) for i in range(6)]
    out = scheduler.schedule()
    assert [len(s.draft_token_ids) for s in out.scheduled] == [2, 1]
    scheduler.update(out.scheduled, worker.execute(out.scheduled))
    assert by_tokens.num_tokens == 5 + 4 and by_length.num_tokens == 8
    finish_all_and_check_no_leaks(scheduler)


def test_a_prefill_chunk_short_of_the_end_carries_no_drafts():
    scheduler = Scheduler(KVCacheManager(64, PAGE), max_num_batched_tokens=5, max_num_seqs=8)
    request = make_request(0, 12)
    scheduler.add(request)
    request.draft_token_ids = [1, 2]
    out = scheduler.schedule()
    assert out.scheduled[0].draft_token_ids == [] and out.scheduled[0].num_new_tokens == 5
    finish_all_and_check_no_leaks(scheduler)


def test_update_rejects_tokens_that_break_the_row_contract():
    scheduler, worker, request = decoding()
    request.draft_token_ids = [1, 2]
    out = scheduler.schedule()
    with pytest.raises(ValueError, match="do not extend drafts"):
        scheduler.update(out.scheduled, [[5, 2, 9]])
    with pytest.raises(ValueError, match="do not extend drafts"):
        scheduler.update(out.scheduled, [[1, 2, 3, 4]])
    with pytest.raises(ValueError):
        scheduler.update(out.scheduled, [])  # one list per row
    finish_all_and_check_no_leaks(scheduler)
    chunked = Scheduler(KVCacheManager(64, PAGE), max_num_batched_tokens=4, max_num_seqs=8)
    long = make_request(1, 10)
    chunked.add(long)
    out = chunked.schedule()
    with pytest.raises(ValueError, match="samples nothing"):
        chunked.update(out.scheduled, [[5]])
    finish_all_and_check_no_leaks(chunked)


def test_update_skips_a_request_finished_after_schedule():
    scheduler, worker, request = decoding()
    request.draft_token_ids = [1, 2, 3]
    out = scheduler.schedule()
    scheduler.finish(request)  # aborted mid-step
    scheduler.update(out.scheduled, [[1, 2]])
    assert request.page_ids == [] and request.output_token_ids == [target(request, 5)]
    finish_all_and_check_no_leaks(scheduler)
