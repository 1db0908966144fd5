"""Pipeline micro-batches: a step's rows cut into consecutive groups that flow through the stages one
after another, so stage s works on micro-batch i while stage s+1 works on micro-batch i-1.

Without them a step with P stages runs its stages in turn: P-1 of them idle at any moment. With M
micro-batches of equal cost a step takes (M + P - 1) / M stage-times instead of P (the pipeline fills and
drains once per step: the engine's step is synchronous, schedule -> run -> process outputs).

How it overlaps: every stage runs the same loop over the same micro-batches (each rank cuts the step
itself, with the same pure function), and a stage's send to the next is asynchronous
(`hearth.parallel.state.send_to_next_stage`), so stage 0 goes on to micro-batch i+1 as soon as it
has handed i over. The last stage concatenates each micro-batch's logits in order, which is the step's
`logits_indices` order (rows are consecutive and a row's logits are its own last tokens), and samples
once, with the whole step's sampling rows and grammar masks.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable

import torch

from hearth.engine.forward_batch import ForwardBatch
from hearth.parallel.state import PIPELINE_TIME_S, wait_for_sends


def resolve_micro_batches(requested: int, pp_size: int) -> int:
    """`--pipeline-micro-batches`: 0 is 2 x stages (the fill and drain of each step cost 1/(M + P - 1)
    of it, a third with 2 stages); no pipeline, no micro-batches."""
    if pp_size == 1:
        return 1
    return requested or 2 * pp_size


def micro_batch_rows(query_start_loc: list[int], num_micro_batches: int) -> list[range]:
    """Consecutive row ranges with about equal token counts (a row is never cut); at most one per row,
    never an empty one. Pure: every rank computes the same cuts from the same step."""
    num_rows = len(query_start_loc) - 1
    count = max(1, min(num_micro_batches, num_rows))
    total = query_start_loc[-1]
    bounds = [0]
    for k in range(1, count):
        # The row boundary nearest k/count of the tokens, leaving a row for each later part.
        target = total * k / count
        row = bisect_left(query_start_loc, target)
        if row > 0 and target - query_start_loc[row - 1] <= query_start_loc[min(row, num_rows)] - target:
            row -= 1
        row = max(row, bounds[-1] + 1)
        row = min(row, num_rows - (count - k))
        bounds.append(row)
    bounds.append(num_rows)
    return [range(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]


def sub_step(step: ForwardBatch, rows: range) -> ForwardBatch:
    """Rows `rows` of `step` as a step of their own, for the forward pass only: the grammar masks, the page
    tags to set and the finished requests stay with the whole step (applied before / after the forward)."""
    a, b = rows.start, rows.stop
    starts = step.query_start_loc
    t0, t1 = starts[a], starts[b]
    width = step.page_table_width
    indices = step.logits_indices
    first = bisect_left(indices, t0)
    last = bisect_left(indices, t1)
    # The sampling rows whose logits positions fall in [first, last): each takes num_logits positions.
    sampling = []
    position = 0
    for row in step.sampling:
        if first <= position < last:
            sampling.append(row)
        position += row.num_logits
    return ForwardBatch(
        token_ids=step.token_ids[t0:t1],
        positions=step.positions[t0:t1],
        query_start_loc=[start - t0 for start in starts[a : b + 1]],
        seq_lens=step.seq_lens[a:b],
        num_decode_rows=max(0, min(b, step.num_decode_rows) - a),
        page_table=step.page_table[a * width : b * width],
        page_table_width=width,
        slot_mapping=step.slot_mapping[t0:t1],
        logits_indices=[index - t0 for index in indices[first:last]],
        sampling=sampling,
        page_tags=step.page_tags[a * width : b * width] if step.page_tags else [],
    )


def forward_micro_batches(
    forward: Callable[[ForwardBatch], torch.Tensor | None], step: ForwardBatch, num_micro_batches: int
) -> torch.Tensor | None:
    """`forward` (one stage's model forward over one step) over the step's micro-batches, in order; the
    last stage's logits of every micro-batch concatenated (None on the other stages)."""
    start = time.perf_counter()
    parts = [sub_step(step, rows) for rows in micro_batch_rows(step.query_start_loc, num_micro_batches)]
    logits = [forward(part) for part in parts]
    wait_for_sends()  # the send buffers must outlive the transfer; the next step may reuse nothing before
    PIPELINE_TIME_S["forward_s"] += time.perf_counter() - start
    PIPELINE_TIME_S["micro_batches"] += len(parts)
    PIPELINE_TIME_S["steps"] += 1
    if logits[0] is None:
        return None
    return torch.cat(logits) if len(logits) > 1 else logits[0]
