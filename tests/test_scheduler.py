from hearth.engine.request import Request
from hearth.engine.sampling_params import SamplingParams
from hearth.engine.scheduler import Scheduler
from hearth.kv.manager import KVCacheManager
from hearth.kv.prefix_keys import root_key

ROOT = root_key("m")


def make_request(index: int, prompt_len: int, max_tokens: int = 8) -> Request:
    return Request(
        request_id=f"r{index}",
        prompt_token_ids=[index * 1000 + i for i in range(prompt_len)],
        params=SamplingParams(max_tokens=max_tokens),
        prefix_root=ROOT,
        arrival_index=index,
        max_model_len=1000,
    )


def complete_step(scheduler: Scheduler, out, next_token: int = 7) -> None:
    """What the engine does after a forward: one token for every row that samples."""
    scheduler.update(out.scheduled, [[next_token] if item.samples else [] for item in out.scheduled])


def test_chunked_prefill_respects_token_budget_and_decodes_first():
    scheduler = Scheduler(KVCacheManager(64, 4), max_num_batched_tokens=10, max_num_seqs=8)
    a, b = make_request(0, 6), make_request(1, 25)
    scheduler.add(a)
    scheduler.add(b)
    out = scheduler.schedule()
    assert [(s.request, s.num_new_tokens) for s in out.scheduled] == [(a, 6), (b, 4)]
    complete_step(scheduler, out)
    out = scheduler.schedule()
    # a decodes one token; b continues its prefill with the rest of the budget
    assert [(s.request, s.num_new_tokens) for s in out.scheduled] == [(a, 1), (b, 9)]
    assert out.num_tokens <= 10


def test_max_num_seqs_caps_running_requests():
    scheduler = Scheduler(KVCacheManager(64, 4), max_num_batched_tokens=100, max_num_seqs=2)
    for i in range(3):
        scheduler.add(make_request(i, 3))
    out = scheduler.schedule()
    assert len(out.scheduled) == 2 and len(scheduler.waiting) == 1


def test_preemption_takes_the_newest_and_requeues_it_first():
    scheduler = Scheduler(KVCacheManager(4, 2), max_num_batched_tokens=100, max_num_seqs=8)
    old, new = make_request(0, 4), make_request(1, 3)
    scheduler.add(old)
    scheduler.add(new)
    out = scheduler.schedule()  # old: 2 pages, new: 2 pages -> the pool is full
    complete_step(scheduler, out)
    out = scheduler.schedule()  # old needs a third page for its 5th token
    assert out.preempted == [new]
    assert [s.request for s in out.scheduled] == [old]
    assert scheduler.waiting[0] is new and new.page_ids == [] and new.num_computed_tokens == 0


def test_no_starvation_everyone_finishes_under_pressure():
    scheduler = Scheduler(KVCacheManager(6, 2), max_num_batched_tokens=5, max_num_seqs=4)
    requests = [make_request(i, 3, max_tokens=4) for i in range(5)]
    for r in requests:
        scheduler.add(r)
    for _ in range(500):
        if not scheduler.has_work:
            break
        out = scheduler.schedule()
        complete_step(scheduler, out)
        for r in list(scheduler.running):
            if len(r.output_token_ids) >= 4:
                scheduler.finish(r)
    assert not scheduler.has_work
    assert all(len(r.output_token_ids) == 4 for r in requests)
    assert all(count == 0 for count in scheduler.kv.allocator.ref_counts)


def test_finish_of_a_waiting_request_frees_nothing_twice():
    scheduler = Scheduler(KVCacheManager(8, 2), max_num_batched_tokens=100, max_num_seqs=1)
    a, b = make_request(0, 3), make_request(1, 3)
    scheduler.add(a)
    scheduler.add(b)
    complete_step(scheduler, scheduler.schedule())
    scheduler.finish(b)  # aborted while waiting
    scheduler.finish(a)  # aborted while running
    assert not scheduler.has_work
    assert scheduler.kv.num_used_pages == 0
    assert all(count == 0 for count in scheduler.kv.allocator.ref_counts)
    assert scheduler.kv.prefix_cache.num_parked_pages == 1  # a's full first page stays cached
