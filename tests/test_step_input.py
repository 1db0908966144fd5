"""StepInputBuilder: the engine core's per-step deltas (plain Python, milliseconds). What a worker builds
from them is covered in test_persistent_batch.py."""

from __future__ import annotations

import pickle

import msgspec
import pytest

from hearth.contracts.step import StepInput
from hearth.engine.persistent_batch import PersistentBatch
from hearth.engine.sampling_params import SamplingParams
from hearth.engine.scheduler import ScheduledRequest as Row
from hearth.engine.step_input import StepInputBuilder
from tests.test_persistent_batch import PAGE_SIZE, make_request, mixed_batch


def decode_batch(size: int, prompt_tokens: int = 200, page_size: int = 16) -> list[Row]:
    num_pages = -(-(prompt_tokens + 1) // page_size)
    return [
        Row(
            make_request(
                f"r{i}",
                list(range(prompt_tokens)),
                [7],
                computed=prompt_tokens,
                page_ids=list(range(i * num_pages, (i + 1) * num_pages)),
            ),
            1,
        )
        for i in range(size)
    ]


def advance(rows: list[Row], token: int) -> None:
    """What the scheduler does after a decode step: one token computed, one sampled."""
    for row in rows:
        row.request.num_computed_tokens += 1
        row.request.token_ids.append(token)
        row.request.output_token_ids.append(token)


def test_a_request_is_sent_once_then_only_its_new_token():
    rows = decode_batch(2)
    builder = StepInputBuilder(16, check_page_tags=True)
    first = builder.build(rows)
    assert [new.request_id for new in first.new_requests] == ["r0", "r1"]
    assert first.new_requests[0].token_ids == [*range(200), 7]
    assert first.new_requests[0].params == SamplingParams(temperature=0).sampler_params()
    assert [update.page_ids for update in first.page_updates] == [list(range(13)), list(range(13, 26))]
    advance(rows, 9)
    second = builder.build(rows)
    assert second.new_requests == [] and second.page_updates == []
    assert second.appended_token_ids == [9, 9] and second.num_appended_tokens == [1, 1]
    assert second.slots == first.slots and second.starts == [201, 201]


def test_only_new_pages_are_sent_and_a_cut_table_is_cut():
    rows = decode_batch(1, prompt_tokens=15)  # 16 tokens: one full page
    request = rows[0].request
    builder = StepInputBuilder(16)
    builder.build(rows)
    advance(rows, 9)
    request.page_ids.append(40)
    request.page_generations.append(401)
    update = builder.build(rows).page_updates
    assert [(u.num_kept_pages, u.page_ids) for u in update] == [(1, [40])]
    del request.page_ids[1:], request.page_generations[1:]  # a rejected draft's page rolled back
    update = builder.build(rows).page_updates
    assert [(u.num_kept_pages, u.page_ids) for u in update] == [(1, [])]


def test_a_preempted_request_gets_its_new_table_but_keeps_its_slot_and_tokens():
    rows = decode_batch(1, prompt_tokens=20)
    request = rows[0].request
    builder = StepInputBuilder(16, check_page_tags=True)
    first = builder.build(rows)
    request.page_ids[:] = [50, 51]  # preempted, recomputed into other pages of the same count
    request.page_generations[:] = [7, 8]
    request.num_computed_tokens = 0
    step = builder.build([Row(request, 21)])
    assert step.new_requests == [] and step.slots == first.slots
    assert [(u.num_kept_pages, u.page_ids, u.page_tags) for u in step.page_updates] == [(0, [50, 51], [7, 8])]
    assert step.starts == [0] and step.num_new_tokens == [21]


def test_finished_slots_are_sent_once_and_reused():
    rows = decode_batch(2)
    builder = StepInputBuilder(16)
    first = builder.build(rows)
    builder.request_finished(rows[0].request.request_id)
    builder.request_finished("never-scheduled")
    again = make_request("new", [1, 2], [], computed=0, page_ids=[99])
    step = builder.build([rows[1], Row(again, 2)])
    assert step.finished_slots == [first.slots[0]]
    assert step.new_requests[0].slot == first.slots[0]  # dropped before added: the slot is free
    assert builder.build([rows[1]]).finished_slots == []


def test_tags_of_handed_out_pages_are_sent_once_and_the_last_tag_of_a_page_wins():
    builder = StepInputBuilder(PAGE_SIZE)
    builder.pages_allocated([2, 1], [21, 11])
    builder.pages_allocated([2, 6], [25, 61])  # page 2 handed out again before the step ran
    step = builder.build([])
    assert dict(zip(step.tag_page_ids, step.tag_values)) == {2: 25, 1: 11, 6: 61}
    assert len(step.tag_page_ids) == 3
    assert builder.build([]).tag_page_ids == []


def test_expected_tags_are_sent_only_when_checking():
    assert all(u.page_tags == [] for u in StepInputBuilder(PAGE_SIZE).build(mixed_batch()).page_updates)
    checked = StepInputBuilder(PAGE_SIZE, check_page_tags=True).build(mixed_batch())
    assert checked.page_updates[0].page_tags == [31, 91]


def test_constrained_rows_need_a_structured_output_manager():
    request = make_request("g", [1, 2], [3], computed=2, page_ids=[0])
    request.grammar = object()  # type: ignore[assignment]
    with pytest.raises(ValueError, match="StructuredOutputManager"):
        StepInputBuilder(PAGE_SIZE).build([Row(request, 1)])


def test_step_input_round_trips_through_msgpack_and_pickle():
    builder = StepInputBuilder(PAGE_SIZE, check_page_tags=True)
    step = builder.build(mixed_batch())
    step.bitmask_rows = [1]
    step.bitmask = b"\x01\x02\x03\x04" * 3
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(step), type=StepInput)
    assert decoded == step
    assert pickle.loads(pickle.dumps(step)) == step


def test_the_worker_state_follows_the_requests_across_steps():
    """Decoded deltas applied step after step give the worker the engine core's tokens and pages."""
    rows = decode_batch(3, prompt_tokens=14)
    builder = StepInputBuilder(16, check_page_tags=True)
    state = PersistentBatch(16, check_page_tags=True)
    decoder = msgspec.msgpack.Decoder(StepInput)
    for step_index in range(6):
        for row in rows:
            needed = -(-(row.request.num_computed_tokens + 1) // 16)
            while len(row.request.page_ids) < needed:
                row.request.page_ids.append(100 + step_index)
                row.request.page_generations.append(1000 + step_index)
        state.apply(decoder.decode(msgspec.msgpack.encode(builder.build(rows))))
        for row in rows:
            held = state.requests[builder._sent[row.request.request_id].slot]
            assert held.tokens == row.request.token_ids
            assert held.pages == row.request.page_ids and held.tags == row.request.page_generations
        advance(rows, 20 + step_index)


def test_a_steady_decode_step_of_64_rows_is_small():
    rows = decode_batch(64)
    builder = StepInputBuilder(16, check_page_tags=True)
    builder.build(rows)
    advance(rows, 9)
    size = len(msgspec.msgpack.encode(builder.build(rows)))
    assert size < 1200  # ~10 bytes a row (the full step was ~350)


def test_building_a_decode_batch_of_64_is_cheap():
    import time

    rows = decode_batch(64)
    builder = StepInputBuilder(16)
    builder.build(rows)
    start = time.perf_counter()
    for _ in range(20):
        builder.build(rows)
    per_step_s = (time.perf_counter() - start) / 20
    assert per_step_s < 2e-3  # ~0.05 ms on a quiet machine; generous for a loaded one


def test_an_entry_changed_in_place_reaches_the_workers():
    """The workers' integrity check must see the table the engine core believes in, even a wrong one."""
    rows = decode_batch(1, prompt_tokens=40)
    request = rows[0].request
    builder = StepInputBuilder(16, check_page_tags=True)
    builder.build(rows)
    request.page_ids[0], request.page_ids[2] = request.page_ids[2], request.page_ids[0]
    [update] = builder.build(rows).page_updates
    assert (update.num_kept_pages, update.page_ids) == (0, request.page_ids)


def test_a_continuation_is_one_position_further_and_the_workers_append_the_sampled_token():
    """Overlap scheduling: step N+1 is built before N's tokens are read; each worker appends them itself."""
    rows = decode_batch(3, prompt_tokens=14)
    builder = StepInputBuilder(16)
    state = PersistentBatch(16)
    state.apply(builder.build(rows))
    continued = [rows[2], rows[0]]  # rows 2 and 0 of step N go on (row 1's request ends at N)
    step = builder.build(continued, previous_rows=[2, 0])
    assert step.new_requests == [] and step.appended_token_ids == []
    assert step.starts == [15, 15] and step.num_new_tokens == [1, 1]
    state.apply(step, previous_sampled=[[40], [41], [42]])  # what step N sampled, per sampled row
    for row, token in zip(continued, (42, 40), strict=True):
        assert state.requests[builder._sent[row.request.request_id].slot].tokens == [
            *row.request.token_ids,
            token,
        ]
    assert state.flatten(step).token_ids == [42, 40] and state.flatten(step).positions == [15, 15]
    for row, token in zip(rows, (40, 41, 42), strict=True):  # the engine core files N's tokens
        advance([row], token)
    after = builder.build(continued)  # the workers already hold the tokens: nothing is appended
    assert after.appended_token_ids == [] and after.new_requests == []


def test_a_request_the_workers_hold_a_token_ahead_of_is_sent_again_under_its_slot():
    """A continued row whose step-N row was sent back to recompute: its N token was never kept."""
    rows = decode_batch(1, prompt_tokens=14)
    builder = StepInputBuilder(16)
    state = PersistentBatch(16)
    state.apply(builder.build(rows))
    state.apply(builder.build(rows, previous_rows=[0]), previous_sampled=[[]])
    request = rows[0].request
    request.num_computed_tokens = 0  # back to waiting, then rescheduled as one prefill
    again = builder.build([Row(request, len(request.token_ids))])
    assert [new.slot for new in again.new_requests] == again.slots
    state.apply(again)
    held = state.requests[again.slots[0]]
    assert held.tokens == request.token_ids and held.pages == request.page_ids
