"""A worker's persistent batch: what it keeps of every running request between steps, and the step's
`ForwardBatch` built from it.

Contract (what the rest of the worker, and CUDA graphs or overlap scheduling later, may rely on):
- `apply(step)` brings the state up to date with a `hearth.contracts.step.StepInput`, in the protocol's
  order: finished slots dropped, new requests stored, page tables updated, tokens appended. After it, a
  request's `tokens` equal the engine core's `request.token_ids` and `pages`/`tags` its `page_ids` /
  `page_generations` (all pages it holds, in position order); with overlap scheduling a request may be one
  token ahead of the core (the previous step's, appended by the worker before the core reads it).
- `flatten(step, skip_rows)` returns the step's rows as one `ForwardBatch` (the lists the model, the
  attention backend and the sampler read), leaving out `skip_rows` (rows that failed the integrity check:
  a row mask on the same state, not a second builder). `kept_sampling` on the result lists, per sampled
  row it kept, its index among the step's sampled rows. It reads the state, never changes it, so it may be
  called again for the same step with another mask.
- Slots are small integers the engine core assigns (reused after a request finishes): a fixed-size device
  buffer indexed by slot can mirror this state for a static-shape (CUDA graph) path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from hearth.contracts.sampling import SamplerParams
from hearth.contracts.step import StepInput
from hearth.engine.forward_batch import ForwardBatch, StepSamplingRow
from hearth.kv.integrity import PADDING_TAG


@dataclass(slots=True)
class RequestState:
    request_id: str
    num_prompt_tokens: int
    tokens: list[int]
    params: SamplerParams
    pages: list[int] = field(default_factory=list)
    tags: list[int] = field(default_factory=list)


class FlatBatch(ForwardBatch):
    """A `ForwardBatch` and, per sampled row it kept, that row's index among the step's sampled rows."""

    kept_sampling: list[int] = []


class PersistentBatch:
    def __init__(self, page_size: int, check_page_tags: bool = False) -> None:
        self.page_size = page_size
        self.check_page_tags = check_page_tags
        self.requests: dict[int, RequestState] = {}  # slot -> state

    def apply(self, step: StepInput, previous_sampled: Sequence[list[int]] = ()) -> list[str]:
        """Updates the state; returns the ids of the requests that finished (their other state goes too).
        `previous_sampled`: the previous step's `StepOutput.sampled_token_ids`, which an overlapped step
        (`step.previous_rows`) appends to its rows (0 for a row that got none: its request does not go on)."""
        if step.previous_rows:
            step.num_appended_tokens = [1] * step.num_rows
            step.appended_token_ids = [
                previous_sampled[row][-1] if row < len(previous_sampled) and previous_sampled[row] else 0
                for row in step.previous_rows
            ]
        requests = self.requests
        finished = [requests.pop(slot).request_id for slot in step.finished_slots if slot in requests]
        for new in step.new_requests:
            requests[new.slot] = RequestState(
                new.request_id, new.num_prompt_tokens, new.token_ids, new.params
            )
        for update in step.page_updates:
            state = requests[update.slot]
            keep = update.num_kept_pages
            del state.pages[keep:]
            del state.tags[keep:]
            state.pages.extend(update.page_ids)
            state.tags.extend(update.page_tags)
        if step.appended_token_ids:
            appended = step.appended_token_ids
            position = 0
            for slot, count in zip(step.slots, step.num_appended_tokens, strict=True):
                if count:
                    requests[slot].tokens.extend(appended[position : position + count])
                    position += count
        return finished

    def flatten(self, step: StepInput, skip_rows: frozenset[int] = frozenset()) -> FlatBatch:
        page_size = self.page_size
        check_tags = self.check_page_tags
        requests = self.requests
        token_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        sampling: list[StepSamplingRow] = []
        kept_sampling: list[int] = []
        row_pages: list[list[int]] = []
        row_tags: list[list[int]] = []
        num_decode_rows = 0
        leading = True
        width = 0
        drafts_per_row = step.num_draft_tokens
        all_drafts = step.draft_token_ids
        draft_position = 0
        non_sampling = set(step.non_sampling_rows) if step.non_sampling_rows else ()
        num_sampled = 0
        # Where each kept row's logits positions start, for the grammar masks (see bitmask_rows below).
        logits_position: dict[int, int] = {}
        for row, (slot, start, num_new) in enumerate(
            zip(step.slots, step.starts, step.num_new_tokens, strict=True)
        ):
            num_drafts = drafts_per_row[row] if drafts_per_row else 0
            drafts = all_drafts[draft_position : draft_position + num_drafts] if num_drafts else []
            draft_position += num_drafts
            samples = row not in non_sampling
            if row in skip_rows:
                num_sampled += samples
                continue
            state = requests[slot]
            pages = state.pages
            end = start + num_new
            if num_new == 1 and not drafts:
                token_ids.append(state.tokens[start])
                positions.append(start)
                slot_mapping.append(pages[start // page_size] * page_size + start % page_size)
                if leading:
                    num_decode_rows += 1
            else:
                leading = False
                token_ids.extend(state.tokens[start : end - num_drafts])
                token_ids.extend(drafts)
                positions.extend(range(start, end))
                position = start
                while position < end:  # one range per page the row writes into
                    offset = position % page_size
                    take = min(page_size - offset, end - position)
                    base = pages[position // page_size] * page_size + offset
                    slot_mapping.extend(range(base, base + take))
                    position += take
            num_pages = -(-end // page_size)
            row_pages.append(pages[:num_pages])
            if num_pages > width:
                width = num_pages
            seq_lens.append(end)
            query_start_loc.append(len(token_ids))
            if check_tags:
                row_tags.append(state.tags[:num_pages])
            if samples:
                logits_position[num_sampled] = len(logits_indices)
                kept_sampling.append(num_sampled)
                num_sampled += 1
                num_tokens = len(token_ids)
                logits_indices.extend(range(num_tokens - 1 - num_drafts, num_tokens))
                params = state.params
                penalties = params.needs_penalties
                num_known = len(state.tokens)
                num_prompt = state.num_prompt_tokens
                sampling.append(
                    StepSamplingRow(
                        request_id=state.request_id,
                        params=params,
                        num_output_tokens=num_known - num_prompt,
                        draft_token_ids=drafts,
                        prompt_token_ids=state.tokens[:num_prompt] if penalties else None,
                        output_token_ids=state.tokens[num_prompt:] if penalties else None,
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
        batch = FlatBatch(
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
            kept_sampling=kept_sampling,
        )
        if step.bitmask_rows:
            batch.bitmask_rows, batch.bitmask = self._masks(step, skip_rows, logits_position)
        if step.prompt_logprob_rows:
            self._prompt_logprobs(step, skip_rows, batch)
        return batch

    def _prompt_logprobs(self, step: StepInput, skip_rows: frozenset[int], batch: ForwardBatch) -> None:
        """The flat-batch rows (and targets) of the step's scored prompt positions, for the rows kept."""
        # Each kept row's first token in the flat batch: skipped rows take none.
        first_token: dict[int, int] = {}
        kept = 0
        for row in range(step.num_rows):
            if row not in skip_rows:
                first_token[row] = batch.query_start_loc[kept]
                kept += 1
        indices: list[int] = []
        targets: list[int] = []
        num_top = 0
        for row, first, count in zip(
            step.prompt_logprob_rows, step.prompt_logprob_starts, step.prompt_logprob_counts, strict=True
        ):
            if row not in first_token:
                continue
            state = self.requests[step.slots[row]]
            base = first_token[row] - step.starts[row]  # position p of the row is flat row base + p
            indices.extend(range(base + first, base + first + count))
            targets.extend(state.tokens[first + 1 : first + count + 1])  # position p scores token p + 1
            num_top = max(num_top, state.params.prompt_logprobs or 0)
        batch.prompt_logits_indices = indices
        batch.prompt_logprob_token_ids = targets
        batch.prompt_logprob_top = num_top

    def _masks(
        self, step: StepInput, skip_rows: frozenset[int], logits_position: dict[int, int]
    ) -> tuple[list[int], bytes]:
        """The step's grammar masks, re-indexed to the kept rows' logits positions (all of them when none
        was skipped: the engine core numbered them over every sampled row)."""
        if not skip_rows:
            return step.bitmask_rows, step.bitmask
        # The engine core's numbering: each sampled row's logits positions, in row order.
        old_start: list[int] = []
        position = 0
        non_sampling = set(step.non_sampling_rows)
        for row in range(step.num_rows):
            if row in non_sampling:
                continue
            old_start.append(position)
            position += 1 + (step.num_draft_tokens[row] if step.num_draft_tokens else 0)
        owner: dict[int, tuple[int, int]] = {}  # old logits position -> (sampled row, offset)
        for index, begin in enumerate(old_start):
            end = old_start[index + 1] if index + 1 < len(old_start) else position
            for old in range(begin, end):
                owner[old] = (index, old - begin)
        width = len(step.bitmask) // len(step.bitmask_rows)
        rows: list[int] = []
        words: list[bytes] = []
        for i, old in enumerate(step.bitmask_rows):
            index, offset = owner[old]
            if index in logits_position:
                rows.append(logits_position[index] + offset)
                words.append(step.bitmask[i * width : (i + 1) * width])
        return rows, b"".join(words)
