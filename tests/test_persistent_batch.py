"""PersistentBatch: a step's deltas applied to the worker's state -> the flat lists the model runs (plain
Python, milliseconds). The rows come from the engine core's StepInputBuilder, as in a real step."""

from __future__ import annotations

from hearth.engine.persistent_batch import FlatBatch, PersistentBatch
from hearth.engine.request import Request
from hearth.engine.sampling_params import SamplingParams
from hearth.engine.scheduler import ScheduledRequest as Row
from hearth.engine.step_input import StepInputBuilder
from hearth.kv.integrity import PADDING_TAG

PAGE_SIZE = 4


def make_request(
    request_id: str,
    prompt: list[int],
    outputs: list[int],
    computed: int,
    page_ids: list[int],
    params: SamplingParams | None = None,
) -> Request:
    request = Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        params=params or SamplingParams(temperature=0),
        prefix_root=b"",
        arrival_index=0,
        max_model_len=1000,
    )
    request.token_ids.extend(outputs)
    request.output_token_ids.extend(outputs)
    request.num_computed_tokens = computed
    request.page_ids = list(page_ids)
    request.page_generations = [10 * p + 1 for p in page_ids]
    return request


def flatten(
    rows: list[Row],
    check_page_tags: bool = False,
    skip_rows: frozenset[int] = frozenset(),
    page_size: int = PAGE_SIZE,
) -> FlatBatch:
    """One step of `rows` as a fresh worker sees it: every request new."""
    step = StepInputBuilder(page_size, check_page_tags).build(rows)
    batch = PersistentBatch(page_size, check_page_tags)
    batch.apply(step)
    return batch.flatten(step, skip_rows)


def per_token_slots(request: Request, start: int, end: int) -> list[int]:
    return [request.page_ids[p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE for p in range(start, end)]


def mixed_batch() -> list[Row]:
    decode_a = make_request("a", [1, 2, 3, 4, 5], [6, 7, 8], computed=7, page_ids=[3, 9])  # 8 tokens
    decode_b = make_request("b", [11, 12, 13, 14], [15], computed=4, page_ids=[5, 2])  # crosses into page 2
    chunk = make_request("c", list(range(100, 111)), [], computed=2, page_ids=[7, 1, 4])  # mid-prompt chunk
    last_chunk = make_request("d", list(range(200, 206)), [], computed=3, page_ids=[8, 6])  # samples
    draft = make_request("e", [31, 32, 33], [34], computed=3, page_ids=[0, 10])
    return [
        Row(decode_a, 1),
        Row(decode_b, 1),
        Row(chunk, 6),
        Row(last_chunk, 3),
        Row(draft, 3, draft_token_ids=[35, 36]),
    ]


def test_builder_lays_out_tokens_positions_slots_and_pages():
    batch = mixed_batch()
    step = flatten(batch, check_page_tags=True)
    assert step.num_decode_rows == 2
    assert step.token_ids == [8, 15, *range(102, 108), 203, 204, 205, 34, 35, 36]
    assert step.positions == [7, 4, *range(2, 8), 3, 4, 5, 3, 4, 5]
    assert step.query_start_loc == [0, 1, 2, 8, 11, 14]
    assert step.seq_lens == [8, 5, 8, 6, 6]
    expected_slots = []
    for row in batch:
        c = row.request.num_computed_tokens
        expected_slots += per_token_slots(row.request, c, c + row.num_new_tokens)
    assert step.slot_mapping == expected_slots
    assert step.page_table_width == 2
    assert step.page_table == [3, 9, 5, 2, 7, 1, 8, 6, 0, 10]
    assert step.page_tags == [31, 91, 51, 21, 71, 11, 81, 61, 1, 101]

    # The mid-prompt chunk does not sample; the draft row samples at its last known token and each draft.
    assert step.logits_indices == [0, 1, 10, 11, 12, 13]
    assert [row.request_id for row in step.sampling] == ["a", "b", "d", "e"]
    assert step.sampling[3].draft_token_ids == [35, 36]
    assert [row.num_output_tokens for row in step.sampling] == [3, 1, 0, 1]


def test_expected_tags_are_laid_out_like_the_page_table():
    short = make_request("s", [1, 2], [3], computed=2, page_ids=[4])
    long = make_request("l", list(range(9)), [], computed=0, page_ids=[9, 8, 7])
    step = flatten([Row(short, 1), Row(long, 9)], check_page_tags=True)
    assert step.page_table == [4, 0, 0, 9, 8, 7]
    assert step.page_tags == [41, PADDING_TAG, PADDING_TAG, 91, 81, 71]


def test_a_long_row_pads_the_page_table_of_the_others():
    short = make_request("s", [1, 2], [3], computed=2, page_ids=[4])
    long = make_request("l", list(range(30)), [], computed=0, page_ids=[9, 8, 7, 6, 5, 3, 2, 1])
    step = flatten([Row(short, 1), Row(long, 30)])
    assert step.page_table_width == 8
    assert step.page_table == [4, 0, 0, 0, 0, 0, 0, 0, 9, 8, 7, 6, 5, 3, 2, 1]
    assert step.slot_mapping == per_token_slots(short, 2, 3) + per_token_slots(long, 0, 30)
    assert step.page_tags == []  # checking is off


def test_penalty_rows_carry_their_history_and_others_do_not():
    penalized = make_request(
        "p", [1, 2], [3], computed=2, page_ids=[0], params=SamplingParams(repetition_penalty=1.2)
    )
    plain = make_request("q", [4, 5], [6], computed=2, page_ids=[1])
    step = flatten([Row(penalized, 1), Row(plain, 1)])
    assert step.sampling[0].prompt_token_ids == [1, 2] and step.sampling[0].output_token_ids == [3]
    assert step.sampling[1].prompt_token_ids is None and step.sampling[1].output_token_ids is None


def test_a_masked_row_is_left_out_and_the_others_stay_exactly_as_they_were():
    batch = mixed_batch()
    step = StepInputBuilder(PAGE_SIZE, True).build(batch)
    state = PersistentBatch(PAGE_SIZE, True)
    state.apply(step)
    kept = state.flatten(step, frozenset({1, 3}))
    alone = flatten([batch[0], batch[2], batch[4]], check_page_tags=True)
    for name in ("token_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "logits_indices"):
        assert getattr(kept, name) == getattr(alone, name), name
    assert kept.num_decode_rows == 1
    assert kept.page_tags == alone.page_tags
    assert [row.request_id for row in kept.sampling] == ["a", "e"]
    assert kept.kept_sampling == [0, 3]  # indices among the step's sampled rows a, b, d, e
    assert state.flatten(step).sampling == flatten(batch, check_page_tags=True).sampling  # state untouched


def test_grammar_masks_follow_their_rows_when_a_row_is_masked():
    batch = mixed_batch()
    step = StepInputBuilder(PAGE_SIZE).build(batch)
    step.bitmask_rows = [1, 3, 4]  # b's position, and e's first two (its known token and first draft)
    step.bitmask = b"BBBB" + b"EEEE" + b"FFFF"
    state = PersistentBatch(PAGE_SIZE)
    state.apply(step)
    assert state.flatten(step).bitmask_rows == [1, 3, 4]
    kept = state.flatten(step, frozenset({0, 3}))  # a and d out: b then e
    assert kept.bitmask_rows == [0, 1, 2] and kept.bitmask == b"BBBBEEEEFFFF"
    kept = state.flatten(step, frozenset({1}))  # b out: a, d, e
    assert kept.bitmask_rows == [2, 3] and kept.bitmask == b"EEEEFFFF"


def test_flattening_a_decode_batch_of_64_is_cheap():
    import time

    rows = [
        Row(
            make_request(
                f"r{i}", list(range(200)), [7], computed=200, page_ids=list(range(i * 13, i * 13 + 13))
            ),
            1,
        )
        for i in range(64)
    ]
    step = StepInputBuilder(16).build(rows)
    state = PersistentBatch(16)
    state.apply(step)
    start = time.perf_counter()
    for _ in range(20):
        state.flatten(step)
    per_step_s = (time.perf_counter() - start) / 20
    assert per_step_s < 2e-3  # ~0.1 ms on a quiet machine; generous for a loaded one


def test_prompt_logprob_positions_become_logits_rows_after_the_sampled_ones_and_follow_a_mask():
    from hearth.engine import prompt_logprobs

    batch = mixed_batch()
    batch[2].request.params = SamplingParams(temperature=0, prompt_logprobs=2)  # c: positions 2..7
    batch[3].request.params = SamplingParams(temperature=0, prompt_logprobs=5)  # d: positions 3..4
    step = StepInputBuilder(PAGE_SIZE).build(batch)
    chunks = prompt_logprobs.plan(step, batch)
    assert [(row, first, count) for row, _, first, count in chunks] == [(2, 2, 6), (3, 3, 2)]
    state = PersistentBatch(PAGE_SIZE)
    state.apply(step)
    flat = state.flatten(step)
    # c's tokens are flat rows 2..7 (a and b decode first), d's 8..10.
    assert flat.prompt_logits_indices == [2, 3, 4, 5, 6, 7, 8, 9]
    assert flat.prompt_logprob_token_ids == [*range(103, 109), 204, 205]
    assert flat.prompt_logprob_top == 5
    kept = state.flatten(step, frozenset({0, 2}))  # a and c fail the check: d's rows move up
    assert kept.prompt_logits_indices == [1, 2] and kept.prompt_logprob_token_ids == [204, 205]
    assert kept.prompt_logprob_top == 5
