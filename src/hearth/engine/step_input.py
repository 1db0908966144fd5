"""What the engine sends a worker each step: `StepInput`, flat and serializable, and its builder.

`StepInputBuilder.build` turns the scheduler's rows into plain lists of ints (no tensors), so the same
object is handed over by reference in one process and encoded once (msgspec or pickle) for a worker in
another. Building runs every step: it is written per row and per page, never per token in Python.

Row contract (the scheduler's): a `ScheduledRequest(request, num_new_tokens, draft_token_ids)` row computes
`request.token_ids[c : c + num_new_tokens - len(drafts)] + drafts` at positions `c .. c + num_new_tokens - 1`
(`c = request.num_computed_tokens`); its pages (`request.page_ids`) already cover every slot. A row that
`samples` gets 1 + len(drafts) logits positions, its last known token and each draft.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec
import torch

from hearth.contracts.kv_ops import KVOps
from hearth.engine.sampling_params import SamplingParams
from hearth.kv.integrity import PADDING_TAG

if TYPE_CHECKING:
    from hearth.engine.scheduler import ScheduledRequest
    from hearth.engine.structured_output import GrammarMatcher, StructuredOutputManager


class StepSamplingRow(msgspec.Struct, array_like=True, omit_defaults=True):
    """One sampled row: its request, parameters, the drafts to verify, and what penalties need.

    `prompt_token_ids`/`output_token_ids` are sent only for rows with penalties (they are the whole
    history); `num_output_tokens` (generated before this step) is always there, for `min_tokens`.
    """

    request_id: str
    params: SamplingParams
    num_output_tokens: int
    draft_token_ids: list[int] = []
    prompt_token_ids: list[int] | None = None
    output_token_ids: list[int] | None = None

    @property
    def num_logits(self) -> int:
        return 1 + len(self.draft_token_ids)


class StepInput(msgspec.Struct, omit_defaults=True):
    """One step for a worker. Rows in batch order; the first `num_decode_rows` have one query token each.

    - `token_ids`, `positions`, `slot_mapping`: per token of the flat batch (slot = page * page_size + offset).
    - `query_start_loc` (num_rows + 1, cu_seqlens) and `seq_lens` (context length per row after this step).
    - `page_table`: row-major `[num_rows, page_table_width]`; row r's first ceil(seq_lens[r] / page_size)
      entries are its pages in position order, the rest is padding (page 0).
    - `page_tags`: the generation tag expected of every page a row reads, laid out like `page_table`
      (padding entries `PADDING_TAG`), for the integrity check; empty when checking is off.
    - `tag_page_ids`/`tag_values`: pages handed out since the last step and their new tags, as the allocator
      gave them (never read off a request's table, which is what the check distrusts), for the pool's tags.
    - `logits_indices`: flat-batch rows whose logits are sampled, 1 + len(drafts) consecutive ones per
      sampled row, in `sampling` order.
    - `bitmask_rows`/`bitmask`: grammar masks, as indices into `logits_indices` (a constrained row with
      drafts has one per position its grammar reaches) and their little-endian int32 words
      (`len(bitmask_rows)` rows of equal width; bit t allows token t). Bytes, not a list: a 150k vocabulary
      is 4.7k words a row, copied once instead of boxed as Python ints.
    - `finished_request_ids`: requests gone since the last step; the worker drops their state first.
    - `previous_rows`: overlap scheduling (`hearth.engine.overlap`): row r continues the previous step's
      sampled row `previous_rows[r]`, and its input token is the one that row sampled (`token_ids` holds
      placeholders); empty for any other step.
    """

    token_ids: list[int]
    positions: list[int]
    query_start_loc: list[int]
    seq_lens: list[int]
    num_decode_rows: int
    page_table: list[int]
    page_table_width: int
    slot_mapping: list[int]
    logits_indices: list[int]
    sampling: list[StepSamplingRow]
    page_tags: list[int] = []
    tag_page_ids: list[int] = []
    tag_values: list[int] = []
    bitmask_rows: list[int] = []
    bitmask: bytes = b""
    finished_request_ids: list[str] = []
    # The step's KV operations for every rank's worker half of the connectors (hearth.contracts.kv_ops).
    kv_ops: KVOps = msgspec.field(default_factory=KVOps)
    # Prompt logprobs (hearth.engine.prompt_logprobs): flat-batch rows whose logits score the next prompt
    # token, that token, and the most top alternatives any of them wants.
    prompt_logits_indices: list[int] = []
    prompt_logprob_token_ids: list[int] = []
    prompt_logprob_top: int = 0
    previous_rows: list[int] = []

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_rows(self) -> int:
        return len(self.seq_lens)


class StepInputBuilder:
    """Builds each step's `StepInput`; collects what happened in between: requests that finished, and
    pages handed out (`KVCacheManager.take_allocated`) whose tags the pool needs.

    `check_page_tags` fills `StepInput.page_tags` (the integrity check's expected tags); off, they stay empty.
    """

    def __init__(self, page_size: int, check_page_tags: bool = False) -> None:
        self.page_size = page_size
        self.check_page_tags = check_page_tags
        self._finished: list[str] = []
        self._tag_page_ids: list[int] = []
        self._tag_values: list[int] = []

    def request_finished(self, request_id: str) -> None:
        """The worker drops the request's state before the next step runs."""
        self._finished.append(request_id)

    def pages_allocated(self, page_ids: Sequence[int], tags: Sequence[int]) -> None:
        """Pages whose tags the pool gets with the next step (a page handed out twice: the last tag wins)."""
        self._tag_page_ids.extend(page_ids)
        self._tag_values.extend(tags)

    def take_between_steps(self) -> tuple[list[str], list[int], list[int]]:
        """What the next step carries of what happened since the last: finished requests, and pages handed
        out with their tags (one per page, the last given)."""
        finished, self._finished = self._finished, []
        tag_page_ids, self._tag_page_ids = self._tag_page_ids, []
        tag_values, self._tag_values = self._tag_values, []
        if len(set(tag_page_ids)) < len(tag_page_ids):  # one tensor write per page: keep each page's last tag
            latest = dict(zip(tag_page_ids, tag_values, strict=True))
            tag_page_ids, tag_values = list(latest), list(latest.values())
        return finished, tag_page_ids, tag_values

    def build(
        self,
        scheduled: Sequence[ScheduledRequest],
        structured: StructuredOutputManager | None = None,
    ) -> StepInput:
        page_size = self.page_size
        check_tags = self.check_page_tags
        token_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        sampling: list[StepSamplingRow] = []
        row_pages: list[list[int]] = []
        row_tags: list[list[int]] = []
        finished, tag_page_ids, tag_values = self.take_between_steps()
        constrained: list[tuple[int, GrammarMatcher, list[int]]] = []
        num_decode_rows = 0
        leading = True
        width = 0
        for item in scheduled:
            request = item.request
            start = request.num_computed_tokens
            num_new = item.num_new_tokens
            drafts = item.draft_token_ids
            end = start + num_new
            page_ids = request.page_ids
            if num_new == 1 and not drafts:
                token_ids.append(request.token_ids[start])
                positions.append(start)
                slot_mapping.append(page_ids[start // page_size] * page_size + start % page_size)
                if leading:
                    num_decode_rows += 1
            else:
                leading = False
                known_end = end - len(drafts)
                token_ids.extend(request.token_ids[start:known_end])
                token_ids.extend(drafts)
                positions.extend(range(start, end))
                position = start
                while position < end:  # one range per page the row writes into
                    offset = position % page_size
                    take = min(page_size - offset, end - position)
                    base = page_ids[position // page_size] * page_size + offset
                    slot_mapping.extend(range(base, base + take))
                    position += take
            num_pages = -(-end // page_size)
            row_pages.append(page_ids[:num_pages])
            if num_pages > width:
                width = num_pages
            seq_lens.append(end)
            query_start_loc.append(len(token_ids))
            if check_tags:
                row_tags.append(request.page_generations[:num_pages])
            if item.samples:
                if request.grammar is not None:
                    constrained.append((len(logits_indices), request.grammar, drafts))
                num_tokens = len(token_ids)
                logits_indices.extend(range(num_tokens - 1 - len(drafts), num_tokens))
                params = request.params
                penalties = params.needs_penalties
                sampling.append(
                    StepSamplingRow(
                        request_id=request.request_id,
                        params=params,
                        num_output_tokens=len(request.output_token_ids),
                        draft_token_ids=drafts,
                        prompt_token_ids=request.prompt_token_ids if penalties else None,
                        output_token_ids=request.output_token_ids if penalties else None,
                    )
                )
        page_table: list[int] = []
        page_tags: list[int] = []
        if check_tags:  # the expected tags laid out in the same pass as the page table
            for pages, tags in zip(row_pages, row_tags, strict=True):
                page_table.extend(pages)
                page_tags.extend(tags)
                if len(pages) < width:
                    page_table.extend([0] * (width - len(pages)))
                    page_tags.extend([PADDING_TAG] * (width - len(pages)))
        else:
            for pages in row_pages:
                page_table.extend(pages)
                if len(pages) < width:
                    page_table.extend([0] * (width - len(pages)))
        step = StepInput(
            token_ids=token_ids,
            positions=positions,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            num_decode_rows=num_decode_rows,
            page_table=page_table,
            page_table_width=width,
            slot_mapping=slot_mapping,
            logits_indices=logits_indices,
            sampling=sampling,
            page_tags=page_tags,
            tag_page_ids=tag_page_ids,
            tag_values=tag_values,
            finished_request_ids=finished,
        )
        if constrained:
            if structured is None:
                raise ValueError("constrained rows in the batch, but no StructuredOutputManager to mask them")
            self._add_bitmask(step, constrained, structured)
        return step

    @staticmethod
    def _add_bitmask(
        step: StepInput,
        constrained: list[tuple[int, GrammarMatcher, list[int]]],
        structured: StructuredOutputManager,
    ) -> None:
        """Grammar masks: rows without drafts in one batched call; a row with drafts gets one mask per
        position its grammar reaches (see `StructuredOutputManager.compute_draft_bitmask`)."""
        plain = [(row, matcher) for row, matcher, drafts in constrained if not drafts]
        rows = [row for row, _ in plain]
        parts = [structured.compute_bitmask([matcher for _, matcher in plain])[1]] if plain else []
        for row, matcher, drafts in constrained:
            if drafts:
                words = structured.compute_draft_bitmask(matcher, drafts)
                rows.extend(range(row, row + words.shape[0]))
                parts.append(words)
        step.bitmask_rows = rows
        step.bitmask = (parts[0] if len(parts) == 1 else torch.cat(parts)).numpy().tobytes()
