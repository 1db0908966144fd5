"""The step input of a proposer's own forward (a draft model's, an EAGLE-3 head's) over its own paged KV:
rows of (sequence, tokens to feed after its computed ones)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from hearth.engine.forward_batch import ForwardBatch


class PagedSequence(Protocol):
    """A proposer's view of one request: its pages in the proposer's pool and how much of it they hold."""

    page_ids: list[int]
    num_computed_tokens: int


def decode_rows_first(feeds: Sequence[Sequence[int]]) -> list[int]:
    """Row order with the one-token rows first: the attention backend takes them as one decode batch."""
    return sorted(range(len(feeds)), key=lambda i: len(feeds[i]) != 1)


def proposer_step_input(
    rows: Sequence[tuple[PagedSequence, Sequence[int]]], order: Sequence[int], page_size: int
) -> ForwardBatch:
    """The rows in `order` as one step (logits at each row's last token, no sampling); advances each
    sequence's `num_computed_tokens` past its feed."""
    token_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    query_start_loc = [0]
    seq_lens: list[int] = []
    row_pages: list[list[int]] = []
    logits_indices: list[int] = []
    num_decode_rows = 0
    for i in order:
        sequence, feed = rows[i]
        start = sequence.num_computed_tokens
        end = start + len(feed)
        if len(feed) == 1 and num_decode_rows == len(seq_lens):
            num_decode_rows += 1
        token_ids.extend(feed)
        positions.extend(range(start, end))
        page_ids = sequence.page_ids
        slot_mapping.extend(page_ids[p // page_size] * page_size + p % page_size for p in range(start, end))
        query_start_loc.append(len(token_ids))
        seq_lens.append(end)
        row_pages.append(page_ids[: -(-end // page_size)])
        logits_indices.append(len(token_ids) - 1)
        sequence.num_computed_tokens = end
    width = max(len(pages) for pages in row_pages)
    return ForwardBatch(
        token_ids=token_ids,
        positions=positions,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        num_decode_rows=num_decode_rows,
        page_table=[p for pages in row_pages for p in pages + [0] * (width - len(pages))],
        page_table_width=width,
        slot_mapping=slot_mapping,
        logits_indices=logits_indices,
        sampling=[],
    )
