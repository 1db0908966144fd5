"""Pipeline micro-batches (hearth.engine.ranks.microbatch): how a step is cut, and that the cut steps'
logits, concatenated, are the whole step's (one process: the stage is first and last, so the forward
runs its micro-batches in turn with nothing to send)."""

from __future__ import annotations

import torch
from test_worker import PAGE_SIZE, Requests, advance, flatten_rows

from hearth import LLM
from hearth.engine.ranks.microbatch import forward_micro_batches, micro_batch_rows, sub_step
from hearth.engine.scheduler import ScheduledRequest as Row


def test_rows_are_cut_into_consecutive_parts_of_about_equal_tokens():
    decode_64 = list(range(65))  # 64 decode rows, one token each
    assert micro_batch_rows(decode_64, 4) == [range(0, 16), range(16, 32), range(32, 48), range(48, 64)]
    # A long prompt chunk is never cut: it is a part of its own, the decode rows share the rest.
    mixed = [0, 1, 2, 3, 4, 104]
    assert micro_batch_rows(mixed, 2) == [range(0, 4), range(4, 5)]
    # More parts than rows: one row each; never an empty part.
    assert micro_batch_rows([0, 5, 9], 4) == [range(0, 1), range(1, 2)]
    assert micro_batch_rows([0, 100, 101, 102], 3) == [range(0, 1), range(1, 2), range(2, 3)]
    assert micro_batch_rows([0, 7], 1) == [range(0, 1)]


def test_a_sub_step_keeps_its_rows_tokens_pages_and_sampling_rows():
    requests = Requests()
    a = requests.new("a", list(range(1, 11)))
    b = requests.new("b", list(range(20, 26)))
    c = requests.new("c", list(range(30, 35)))
    step = flatten_rows([Row(a, 10), Row(b, 6), Row(c, 5)], check_page_tags=True)
    first, second = (sub_step(step, rows) for rows in micro_batch_rows(step.query_start_loc, 2))
    assert first.token_ids == list(range(1, 11)) and first.query_start_loc == [0, 10]
    assert second.token_ids == list(range(20, 26)) + list(range(30, 35))
    assert second.query_start_loc == [0, 6, 11] and second.seq_lens == [6, 5]
    assert second.page_table == step.page_table[step.page_table_width :]
    assert second.page_tags == step.page_tags[step.page_table_width :]
    assert second.slot_mapping == step.slot_mapping[10:]
    assert first.logits_indices == [9] and second.logits_indices == [5, 10]
    assert [r.request_id for r in first.sampling + second.sampling] == ["a", "b", "c"]


@torch.inference_mode()
def test_micro_batched_logits_are_the_whole_steps(tiny_model_factory):
    worker = LLM(str(tiny_model_factory("llama")), dtype="float32", page_size=PAGE_SIZE).engine.worker
    requests = Requests()
    rows = [
        Row(requests.new(f"r{i}", [(7 * i + j) % 500 + 1 for j in range(3 + 2 * i)]), 3 + 2 * i)
        for i in range(6)
    ]
    whole = worker.forward(flatten_rows(rows))
    advance(rows)
    for row in rows:  # the KV written by the whole step is the same the cut steps write again
        row.request.num_computed_tokens = 0
    cut = forward_micro_batches(worker._forward_one, flatten_rows(rows), 4)
    assert cut.shape == whole.shape == (6, whole.shape[1])
    torch.testing.assert_close(cut, whole, rtol=1e-5, atol=1e-5)
    # Decode rows after the prompts: one token each, cut in four parts.
    for i, row in enumerate(rows):
        row.request.num_computed_tokens = len(row.request.token_ids)
        row.request.token_ids.append(i + 40)
        requests.grow(row.request, len(row.request.token_ids))
    decode = [Row(row.request, 1) for row in rows]
    whole = worker.forward(flatten_rows(decode))
    cut = forward_micro_batches(worker._forward_one, flatten_rows(decode), 4)
    torch.testing.assert_close(cut, whole, rtol=1e-5, atol=1e-5)
