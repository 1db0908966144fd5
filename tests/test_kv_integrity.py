"""KV-cache integrity: the batched page-tag check, cutting failing rows out of a step, fault injection, release
by (page, tag), stale prefix-cache names, and the engine's answer (recompute once, then error; or abort)."""

from __future__ import annotations

import logging

import pytest
import torch
from kv_fault_harness import (
    HASH_VOCAB,
    Audit,
    drive,
    hash_engine,
    hash_greedy,
    inject_faults,
    judge,
    random_prompts,
)

from hearth.engine.config import EngineConfig
from hearth.engine.kv_integrity import KV_INTEGRITY_ERROR
from hearth.engine.request import Request
from hearth.engine.sampling_params import SamplingParams
from hearth.engine.scheduler import ScheduledRequest as Row
from hearth.kv.allocator import PageAllocator
from hearth.kv.faults import KVFaultInjector, parse_faults
from hearth.kv.integrity import PADDING_TAG, BatchedPageTagCheck, NoPageTagCheck
from hearth.kv.manager import KVCacheManager
from hearth.ops import cpu_kernels
from tests.test_persistent_batch import flatten

PAGE_SIZE = 4


@pytest.fixture(autouse=True)
def _quiet_integrity_log():
    logger = logging.getLogger("hearth.integrity")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    yield
    logger.setLevel(level)


def make_request(
    request_id: str, prompt: list[int], outputs: list[int], computed: int, pages: list[int]
) -> Request:
    request = Request(request_id, list(prompt), SamplingParams(temperature=0), b"", 0, 1000)
    request.token_ids.extend(outputs)
    request.output_token_ids.extend(outputs)
    request.num_computed_tokens = computed
    request.page_ids = list(pages)
    request.page_generations = [100 + page for page in pages]
    return request


def mixed_batch() -> list[Row]:
    """A decode row, a prefill chunk reading a cached page, a last chunk, and a decode row with drafts."""
    decode = make_request("decode", [1, 2, 3, 4, 5], [6, 7, 8], computed=7, pages=[3, 9])
    chunk = make_request("chunk", list(range(100, 111)), [], computed=4, pages=[7, 1, 4])  # page 7 cached
    last = make_request("last", list(range(200, 206)), [], computed=3, pages=[8, 6])
    draft = make_request("draft", [31, 32, 33], [34], computed=3, pages=[0, 10])
    return [Row(decode, 1), Row(chunk, 6), Row(last, 3), Row(draft, 3, draft_token_ids=[35, 36])]


def pool_tags_for(batch: list[Row], num_pages: int = 16) -> torch.Tensor:
    tags = torch.zeros(num_pages, dtype=torch.int64)
    for row in batch:
        for page, tag in zip(row.request.page_ids, row.request.page_generations, strict=True):
            tags[page] = tag
    return tags


def check(step, tags: torch.Tensor):
    return BatchedPageTagCheck().check(tags, step.page_table, step.page_table_width, step.page_tags)


@pytest.fixture(params=["numpy", "compiled"])
def check_path(request, monkeypatch):
    """Each check test runs on both CPU implementations: the compiled call, and NumPy (before the kernels are
    built, or with HEARTH_CPU_KERNELS=0)."""
    if request.param == "numpy":
        monkeypatch.setattr(cpu_kernels, "_check_page_tags", None)
    else:
        cpu_kernels.paged_decode_attention_kernel(wait=True)
        if cpu_kernels.check_page_tags_kernel() is None:
            pytest.skip("no C++ toolchain for torch extensions here")
    return request.param


# ---- the batched check --------------------------------------------------------------------------------


def test_matching_tables_pass_and_padding_is_never_compared(check_path):
    batch = mixed_batch()
    step = flatten(check_page_tags=True, rows=batch)
    assert PADDING_TAG in step.page_tags  # the decode row's table is padded to the chunk's width
    assert check(step, pool_tags_for(batch)) == []


@pytest.mark.parametrize(
    ("row", "page_index", "what"),
    [
        (0, 1, "the page a decode row writes into"),
        (1, 0, "a cached page a prefill chunk reads"),
        (2, 1, "the new page of a last chunk"),
        (3, 1, "the page a row's drafts are verified in"),
    ],
)
def test_a_reused_page_fails_exactly_its_row(row, page_index, what, check_path):
    batch = mixed_batch()
    step = flatten(check_page_tags=True, rows=batch)
    tags = pool_tags_for(batch)
    page = batch[row].request.page_ids[page_index]
    tags[page] = 999  # handed to another request meanwhile
    [mismatch] = check(step, tags)
    assert (mismatch.row, mismatch.page_index, mismatch.page_id) == (row, page_index, page), what
    assert (mismatch.expected_tag, mismatch.found_tag) == (100 + page, 999)


def test_swapped_entries_are_caught_because_no_two_allocations_share_a_tag(check_path):
    allocator = PageAllocator(4)
    pages = [allocator.allocate() for _ in range(3)]
    request = make_request("r", list(range(10)), [], computed=9, pages=pages)
    request.page_generations = [allocator.generations[page] for page in pages]
    assert len(set(request.page_generations)) == 3
    tags = torch.tensor(allocator.generations)
    request.page_ids[0], request.page_ids[2] = request.page_ids[2], request.page_ids[0]
    step = flatten(check_page_tags=True, rows=[Row(request, 1)])
    assert sorted(m.page_index for m in check(step, tags)) == [0, 2]


def test_the_no_op_tracker_compares_nothing(check_path):
    batch = mixed_batch()
    step = flatten(check_page_tags=True, rows=batch)
    assert (
        NoPageTagCheck().check(torch.zeros(16, dtype=torch.int64), step.page_table, 3, step.page_tags) == []
    )
    unchecked = flatten(batch)
    assert unchecked.page_tags == []
    assert BatchedPageTagCheck().check(torch.zeros(16, dtype=torch.int64), unchecked.page_table, 3, []) == []


def test_both_implementations_report_the_same_entries_on_random_tables():
    """The compiled check against the NumPy one: random tables with padding, reused and swapped pages."""
    cpu_kernels.paged_decode_attention_kernel(wait=True)
    kernel = cpu_kernels.check_page_tags_kernel()
    if kernel is None:
        pytest.skip("no C++ toolchain for torch extensions here")
    generator = torch.Generator().manual_seed(0)
    for trial in range(200):
        num_pages, rows, width = 64, 1 + trial % 9, 1 + trial % 13
        pool = torch.randint(1, 10_000, (num_pages,), generator=generator)
        table = torch.randint(0, num_pages, (rows, width), generator=generator)
        expected = pool[table].clone()
        lengths = torch.randint(1, width + 1, (rows,), generator=generator)
        padding = torch.arange(width)[None, :] >= lengths[:, None]
        expected[padding] = PADDING_TAG
        table[padding] = 0
        wrong = torch.rand(rows, width, generator=generator) < 0.05
        expected[wrong & ~padding] += 1  # reused since the request recorded it
        page_table, tags = table.flatten().tolist(), expected.flatten().tolist()
        compiled = BatchedPageTagCheck().check(pool, page_table, width, tags)
        cpu_kernels._check_page_tags = None
        try:
            reference = BatchedPageTagCheck().check(pool, page_table, width, tags)
        finally:
            cpu_kernels._check_page_tags = kernel
        assert compiled == reference
        assert len(compiled) == int((wrong & ~padding).sum())


def test_the_compiled_check_reports_an_id_outside_the_pool_without_reading_it(check_path):
    if check_path == "numpy":
        pytest.skip("the NumPy version raises IndexError: only the compiled one names the row")
    pool = torch.tensor([5, 6, 7], dtype=torch.int64)
    [mismatch] = BatchedPageTagCheck().check(pool, [0, 1, 2, 0, 9, 2], 3, [5, 6, 7, 5, 8, PADDING_TAG])
    assert (mismatch.row, mismatch.page_index, mismatch.page_id) == (1, 1, 9)
    assert (mismatch.expected_tag, mismatch.found_tag) == (8, PADDING_TAG)
    with pytest.raises(TypeError):  # the lists must hold ints
        cpu_kernels.check_page_tags_kernel()(pool, [0, "1"], [5, 6], PADDING_TAG)


# ---- fault injection and release by (page, tag) -------------------------------------------------------


class Holder:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.page_ids: list[int] = []
        self.page_generations: list[int] = []
        self.num_computed_tokens = 0
        self.cached_page_count = 0
        self.page_keys: list[bytes] = []
        self.all_token_ids = list(range(64))
        self.prefix_root = b"root"


def test_parse_faults_and_unset_costs_nothing():
    assert parse_faults("early_free:0.01, table_swap:0.005") == {"early_free": 0.01, "table_swap": 0.005}
    assert KVFaultInjector.from_env(0, {}) is None
    assert KVFaultInjector.from_env(0, {"HEARTH_KV_FAULTS": "early_free:0"}) is None
    with pytest.raises(ValueError, match="KIND:PROBABILITY"):
        parse_faults("bit_flip:0.1")
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        parse_faults("early_free:2")


def test_early_free_hands_the_page_to_the_next_allocation_with_a_new_tag():
    kv = KVCacheManager(8, PAGE_SIZE, enable_prefix_caching=False)
    victim, other = Holder("victim"), Holder("other")
    kv.allocate_slots(victim, 8)
    injector = KVFaultInjector({"early_free": 1.0}, seed=3, victims=lambda: [victim])
    kv.faults = injector
    kv.allocate_slots(other, 1)  # this allocation triggers the fault; the next one takes the freed page
    kv.faults = None
    [fault] = injector.injected
    assert fault.request_ids == ("victim",)
    kv.allocate_slots(other, 5)
    freed = fault.page_ids[0]
    assert freed in other.page_ids
    index = victim.page_ids.index(freed)
    assert kv.allocator.generations[freed] != victim.page_generations[index]
    # Releasing the victim leaves the new holder's reference alone; releasing both leaks nothing.
    kv.free(victim)
    assert kv.allocator.ref_counts[freed] == 1
    kv.free(other)
    assert kv.num_available_pages == 8 and sum(kv.allocator.ref_counts) == 0


def test_table_swap_is_released_without_leaking_or_double_freeing():
    kv = KVCacheManager(8, PAGE_SIZE, enable_prefix_caching=False)
    victim = Holder("victim")
    kv.allocate_slots(victim, 12)
    before = list(victim.page_ids)
    KVFaultInjector({"table_swap": 1.0}, seed=1, victims=lambda: [victim])._table_swap()
    assert sorted(victim.page_ids) == sorted(before) and victim.page_ids != before
    kv.free(victim)
    assert kv.num_available_pages == 8 and sum(kv.allocator.ref_counts) == 0


def test_a_cached_page_freed_under_its_name_is_never_matched_again():
    kv = KVCacheManager(8, PAGE_SIZE)
    first = Holder("first")
    kv.allocate_slots(first, 8)
    first.num_computed_tokens = 8
    kv.cache_full_pages(first)  # two named pages
    page = first.page_ids[0]
    kv.allocator.reclaim(page)  # a bookkeeping bug frees it while it is still named and read
    reader = Holder("reader")
    assert kv.match_prefix(reader, 12) == 0  # the name of a page on the free list is a miss
    assert not kv.prefix_cache.is_cached(page)
    kv.free(first)
    assert kv.num_available_pages == 8


def test_reallocating_a_named_page_drops_its_name():
    kv = KVCacheManager(2, PAGE_SIZE)
    first = Holder("first")
    kv.allocate_slots(first, 4)
    first.num_computed_tokens = 4
    kv.cache_full_pages(first)
    page = first.page_ids[0]
    kv.allocator.reclaim(page)
    kv.allocate_slots(Holder("thief"), 1)  # gets the page: its content is about to change
    assert not kv.prefix_cache.is_cached(page)


# ---- the engine's answer ------------------------------------------------------------------------------


def run_hash(
    faults: dict[str, float],
    integrity: bool,
    num_requests: int,
    action: str = "recompute",
    abort: float = 0.0,
    num_pages: int = 160,
    **options: int,
):
    engine = hash_engine(num_pages=num_pages, kv_integrity=integrity, action=action, **options)
    injector = inject_faults(engine, faults, seed=7) if faults else None
    audit = Audit()
    audit.attach(engine)
    prompts = random_prompts(num_requests, 5, 3, 30, HASH_VOCAB, shared_prefixes=6, prefix_len=10)
    answers = drive(engine, prompts, 12, abort_probability=abort)
    verdict = judge(answers, {rid: hash_greedy(prompt, 12) for rid, prompt in prompts.items()})
    return engine, injector, audit, answers, verdict


def test_with_faults_and_integrity_on_no_wrong_token_is_ever_returned():
    engine, injector, audit, answers, verdict = run_hash({"early_free": 0.02, "table_swap": 0.01}, True, 500)
    assert injector is not None and sum(injector.counts().values()) > 100
    assert verdict.num_wrong == 0, verdict.wrong_request_ids[:5]
    assert (
        audit.inconsistent and audit.detected == audit.inconsistent
    )  # every bad read caught, no false alarm
    assert engine.integrity.num_recomputed > 0 and verdict.num_correct > 0.8 * verdict.num_requests
    errors = [a for a in answers.values() if a.finish_reason == "error"]
    assert all(a.error_code == KV_INTEGRITY_ERROR for a in errors)
    assert engine.stats().kv_integrity_failures_total == engine.integrity.num_failures > 0
    assert engine.kv.num_available_pages == engine.kv.num_pages  # nothing leaked


def test_with_faults_and_integrity_off_wrong_answers_appear():
    _, injector, audit, _, verdict = run_hash({"early_free": 0.02, "table_swap": 0.01}, False, 300)
    assert audit.inconsistent and not audit.detected
    assert verdict.num_wrong > 0


def test_abort_action_fails_the_request_at_its_first_mismatch():
    engine, _, _, answers, verdict = run_hash({"table_swap": 0.02}, True, 200, action="abort")
    assert verdict.num_wrong == 0 and verdict.num_error > 0
    assert engine.integrity.num_recomputed == 0


def test_no_false_positives_on_a_long_mixed_run():
    """Prefix reuse, preemption in a small pool, chunked prefill, and aborts; no faults: nothing trips."""
    engine, _, audit, _, verdict = run_hash(
        {}, True, 800, abort=0.003, num_pages=48, max_num_batched_tokens=24
    )
    assert engine.integrity.num_failures == 0 and not audit.inconsistent
    assert verdict.num_wrong == 0 and verdict.num_error == 0 and verdict.num_aborted > 0
    assert engine.stats().num_preemptions_total > 0 and engine.kv.stats.hit_tokens > 0


def test_engine_options_name_the_integrity_settings():
    assert EngineConfig(model="m").kv_integrity is True
    assert EngineConfig(model="m").kv_integrity_action == "recompute"
    with pytest.raises(ValueError, match="kv_integrity_action"):
        EngineConfig(model="m", kv_integrity_action="ignore")


class RecordingScheduler:
    def __init__(self) -> None:
        self.recomputed: list[str] = []
        self.forgotten: list[str] = []

    def recompute(self, request: Request, suspect: list[int]) -> None:
        self.recomputed.append(request.request_id)

    def forget_suspect_pages(self, request: Request, suspect: list[int]) -> None:
        self.forgotten.append(request.request_id)


def test_the_first_failure_is_recomputed_and_the_second_ends_in_error_even_after_progress():
    from hearth.engine.kv_integrity import KVIntegrityPolicy
    from hearth.kv.integrity import PageTagMismatch

    scheduler = RecordingScheduler()
    policy = KVIntegrityPolicy(scheduler)  # type: ignore[arg-type]
    request = make_request("r", [1, 2, 3], [4], computed=3, pages=[5])
    other = make_request("o", [1, 2], [4], computed=2, pages=[6])
    batch = [Row(request, 1), Row(other, 1)]
    mismatch = [PageTagMismatch(0, 0, 5, 105, 7)]
    assert policy.handle(batch, mismatch) == [] and scheduler.recomputed == ["r"]
    request.token_ids.append(9)  # progress after the recompute does not earn another one
    [(failed, message)] = policy.handle(batch, mismatch)
    assert failed is request and "2 time(s)" in message and "expected tag 105, found 7" in message
    assert scheduler.recomputed == ["r"] and scheduler.forgotten == ["r"]
    # Counted per request: another request's first failure is still recomputed.
    assert policy.handle(batch, [PageTagMismatch(1, 0, 6, 106, 8)]) == [] and scheduler.recomputed == [
        "r",
        "o",
    ]
    assert policy.num_failures == 3 and policy.num_recomputed == 2


# ---- content checks where pages cross a boundary --------------------------------------------------------


def test_page_checksums_find_the_one_corrupted_page_of_a_transfer():
    from hearth.kv.integrity import failing_pages, page_checksums
    from hearth.kv.pool import KVLayout, KVPool

    pool = KVPool(KVLayout(2, 2, 4, PAGE_SIZE, torch.float32), 6)
    pool.storage.normal_()
    sent = pool.read_pages([1, 4, 5])
    checksums = page_checksums(sent)
    assert len(set(checksums)) == 3
    received = sent.clone()
    received[1, 0, 2, 3, 1, 0] += 1.0  # one value of the last page, in the second layer's K
    assert failing_pages(received, checksums) == [2]
    assert failing_pages(sent, checksums) == []


def test_a_load_for_pages_handed_to_someone_else_is_dropped():
    from hearth.kv.integrity import StalePageError, check_destination_tags

    tags = torch.tensor([0, 11, 12, 13])
    check_destination_tags(tags, [1, 3], [11, 13])
    tags[3] = 20  # the request was aborted and page 3 reallocated before the load arrived
    with pytest.raises(StalePageError, match="dropped"):
        check_destination_tags(tags, [1, 3], [11, 13])


# ---- the same with a real (tiny) transformer ------------------------------------------------------------


def test_tiny_model_under_faults_never_returns_a_wrong_token_and_does_without_the_check(tiny_llama):
    """Integrity on: every answer is the fault-free greedy one, or a correct prefix ending in "error".
    Off, with the same faults: some answers are wrong (the injection bites; the check is what stops it)."""
    from hearth import LLM

    options = dict(dtype="float32", device="cpu", page_size=4, max_num_seqs=16, kv_cache_memory_gib=0.001)
    prompts = random_prompts(60, 11, 3, 24, 500, shared_prefixes=4, prefix_len=9)

    def engine(integrity: bool):
        built = LLM(str(tiny_llama), kv_integrity=integrity, **options).engine
        # KVPool storage is torch.empty and attention reads whole pages: recycled memory holding NaN bit
        # patterns past a row's context turns its logits into NaN (a bug of main's, outside this issue).
        built.worker.kv_pool.storage.zero_()
        return built

    reference = drive(engine(False), prompts, 12)
    expected = {rid: answer.token_ids for rid, answer in reference.items()}
    verdicts = {}
    for integrity in (True, False):
        faulty = engine(integrity)
        inject_faults(faulty, {"early_free": 0.05, "table_swap": 0.03}, seed=4)
        verdicts[integrity] = judge(drive(faulty, prompts, 12), expected)
        if integrity:
            assert faulty.integrity.num_failures > 0
    assert verdicts[True].num_wrong == 0, verdicts[True].wrong_request_ids
    # A dense rate (about one fault per request): a request's second failure ends it, so many end in
    # "error"; the point here is that none returns a wrong token and that most still finish correctly.
    assert verdicts[True].num_correct + verdicts[True].num_error == len(prompts)
    assert verdicts[True].num_correct >= 0.5 * len(prompts)
    assert verdicts[False].num_wrong > 0


def test_overlapped_steps_with_faults_never_return_a_wrong_token():
    """Overlap scheduling over the delta protocol: a continued row whose previous row failed the check (and
    went back to recompute) has its request re-sent, so the worker's tokens never drift from the core's;
    the continued row's own failure is not handled a second time."""
    engine = hash_engine(num_pages=80, max_num_seqs=8, async_scheduling=True)
    injector = inject_faults(engine, {"early_free": 0.05, "table_swap": 0.03}, seed=7)
    prompts = random_prompts(80, 5, 3, 30, HASH_VOCAB, shared_prefixes=6, prefix_len=10)
    answers = drive(engine, prompts, 12, window=8)  # no queue: decode steps continue into the next
    verdict = judge(answers, {rid: hash_greedy(prompt, 12) for rid, prompt in prompts.items()})
    assert engine.runner.overlaps and engine.num_overlapped_steps > 0
    assert sum(injector.counts().values()) > 10 and engine.integrity.num_recomputed > 0
    assert verdict.num_wrong == 0, verdict.wrong_request_ids[:5]
    assert verdict.num_correct + verdict.num_error == verdict.num_requests  # errors: failed twice
    assert verdict.num_correct > verdict.num_requests // 2
    engine.close()
    assert engine.kv.num_available_pages == engine.kv.num_pages  # nothing leaked
