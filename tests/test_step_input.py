"""StepInputBuilder: scheduler rows -> the flat lists a worker runs (plain Python, milliseconds)."""

from __future__ import annotations

import pickle

import msgspec
import pytest

from hearth.engine.request import Request
from hearth.engine.sampling_params import SamplingParams
from hearth.engine.scheduler import ScheduledRequest as Row
from hearth.engine.step_input import StepInput, StepInputBuilder
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
    step = StepInputBuilder(PAGE_SIZE, check_page_tags=True).build(batch)
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

    assert step.tag_page_ids == [] and step.tag_values == []  # only pages the allocator reported get tags
    # The mid-prompt chunk does not sample; the draft row samples at its last known token and each draft.
    assert step.logits_indices == [0, 1, 10, 11, 12, 13]
    assert [row.request_id for row in step.sampling] == ["a", "b", "d", "e"]
    assert step.sampling[3].draft_token_ids == [35, 36]
    assert [row.num_output_tokens for row in step.sampling] == [3, 1, 0, 1]


def test_expected_tags_are_laid_out_like_the_page_table():
    short = make_request("s", [1, 2], [3], computed=2, page_ids=[4])
    long = make_request("l", list(range(9)), [], computed=0, page_ids=[9, 8, 7])
    step = StepInputBuilder(PAGE_SIZE, check_page_tags=True).build([Row(short, 1), Row(long, 9)])
    assert step.page_table == [4, 0, 0, 9, 8, 7]
    assert step.page_tags == [41, PADDING_TAG, PADDING_TAG, 91, 81, 71]


def test_a_long_row_pads_the_page_table_of_the_others():
    short = make_request("s", [1, 2], [3], computed=2, page_ids=[4])
    long = make_request("l", list(range(30)), [], computed=0, page_ids=[9, 8, 7, 6, 5, 3, 2, 1])
    step = StepInputBuilder(PAGE_SIZE).build([Row(short, 1), Row(long, 30)])
    assert step.page_table_width == 8
    assert step.page_table == [4, 0, 0, 0, 0, 0, 0, 0, 9, 8, 7, 6, 5, 3, 2, 1]
    assert step.slot_mapping == per_token_slots(short, 2, 3) + per_token_slots(long, 0, 30)
    assert step.page_tags == []  # checking is off


def test_penalty_rows_carry_their_history_and_others_do_not():
    penalized = make_request(
        "p", [1, 2], [3], computed=2, page_ids=[0], params=SamplingParams(repetition_penalty=1.2)
    )
    plain = make_request("q", [4, 5], [6], computed=2, page_ids=[1])
    step = StepInputBuilder(PAGE_SIZE).build([Row(penalized, 1), Row(plain, 1)])
    assert step.sampling[0].prompt_token_ids == [1, 2] and step.sampling[0].output_token_ids == [3]
    assert step.sampling[1].prompt_token_ids is None and step.sampling[1].output_token_ids is None


def test_tags_of_handed_out_pages_are_sent_once_and_the_last_tag_of_a_page_wins():
    builder = StepInputBuilder(PAGE_SIZE)
    builder.pages_allocated([2, 1], [21, 11])
    builder.pages_allocated([2, 6], [25, 61])  # page 2 handed out again before the step ran
    step = builder.build([])
    assert dict(zip(step.tag_page_ids, step.tag_values)) == {2: 25, 1: 11, 6: 61}
    assert len(step.tag_page_ids) == 3
    assert builder.build([]).tag_page_ids == []


def test_finished_request_ids_are_sent_once():
    builder = StepInputBuilder(PAGE_SIZE)
    builder.request_finished("x")
    builder.request_finished("y")
    assert builder.build([]).finished_request_ids == ["x", "y"]
    assert builder.build([]).finished_request_ids == []


def test_constrained_rows_need_a_structured_output_manager():
    request = make_request("g", [1, 2], [3], computed=2, page_ids=[0])
    request.grammar = object()  # type: ignore[assignment]
    with pytest.raises(ValueError, match="StructuredOutputManager"):
        StepInputBuilder(PAGE_SIZE).build([Row(request, 1)])


def test_step_input_round_trips_through_msgpack_and_pickle():
    builder = StepInputBuilder(PAGE_SIZE, check_page_tags=True)
    builder.request_finished("old")
    step = builder.build(mixed_batch())
    step.bitmask_rows = [1]
    step.bitmask = b"\x01\x02\x03\x04" * 3
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(step), type=StepInput)
    assert decoded == step
    assert decoded.sampling[0].params == SamplingParams(temperature=0)
    assert pickle.loads(pickle.dumps(step)) == step


def test_building_a_decode_batch_of_64_is_cheap():
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
    builder = StepInputBuilder(16)
    builder.build(rows)
    start = time.perf_counter()
    for _ in range(20):
        builder.build(rows)
    per_step_s = (time.perf_counter() - start) / 20
    assert per_step_s < 2e-3  # ~0.15 ms on a quiet machine; generous for a loaded one
