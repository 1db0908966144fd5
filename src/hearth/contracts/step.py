"""The per-step protocol between the engine core (rank 0) and every worker rank.

Each worker keeps a persistent batch (`hearth.engine.persistent_batch`): per request its token ids, its
sampler parameters and its page table. A `StepInput` carries only what changed since the previous step,
so its size grows with the batch by a few bytes a row, not with prompts, histories or page tables:

1. `finished_slots`: requests gone; the worker drops their state first (a slot may be reused below).
2. `new_requests`: a request's first step: its slot (the handle rows use), prompt, tokens so far and
   sampler parameters. Sent once per request (a request re-sent under the same slot replaces its state).
3. `page_updates`: per request whose page table changed: keep its first `num_kept_pages`, then append.
4. `appended_token_ids` (`num_appended_tokens` per row): tokens of a row's request the worker has not seen
   (a decode row: the token sampled last step), appended before the row is built.
5. The rows, in batch order: `slots`, `starts` (tokens already computed), `num_new_tokens`, and the drafts
   to verify (`num_draft_tokens` per row, flattened in `draft_token_ids`; both empty without drafts). A row
   computes `tokens[start : start + num_new - drafts] + drafts` at positions `start ..`; it samples
   unless listed in `non_sampling_rows` (a prompt chunk that does not reach the end of its tokens).
6. `tag_page_ids`/`tag_values`: pages handed out since the last step and their new tags (for the pool's
   tags); `bitmask_rows`/`bitmask`: grammar masks (indices into the step's logits positions, int32 words).

7. `previous_rows` (overlap scheduling, `hearth.engine.overlap`): row r's appended token is the one the
   previous step sampled for its sampled row `previous_rows[r]`; the worker appends it itself (the engine
   core builds this step before reading those tokens). Empty for any other step.
8. Prompt logprobs (`hearth.engine.prompt_logprobs`): row `prompt_logprob_rows[i]` scores its positions
   `prompt_logprob_starts[i] ..` (`prompt_logprob_counts[i]` of them), each position's logits against the
   request's next prompt token, with the top alternatives its `SamplerParams.prompt_logprobs` asks for.

"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from hearth.contracts.kv_ops import KVEvent, KVOps
from hearth.contracts.sampling import SamplerParams


class NewRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    slot: int
    request_id: str
    num_prompt_tokens: int
    token_ids: list[int]  # every token the request has so far (prompt first)
    params: SamplerParams


class PageUpdate(msgspec.Struct, array_like=True, omit_defaults=True):
    """A request's page table becomes `table[:num_kept_pages] + page_ids` (tags likewise: the tag each page
    is expected to carry, for the integrity check)."""

    slot: int
    num_kept_pages: int
    page_ids: list[int]
    page_tags: list[int] = []


class StepInput(msgspec.Struct, omit_defaults=True):
    """One step's deltas for every worker (see the module docstring for the order they apply in)."""

    slots: list[int] = []
    starts: list[int] = []
    num_new_tokens: list[int] = []
    num_appended_tokens: list[int] = []
    appended_token_ids: list[int] = []
    num_draft_tokens: list[int] = []
    draft_token_ids: list[int] = []
    non_sampling_rows: list[int] = []
    new_requests: list[NewRequest] = []
    page_updates: list[PageUpdate] = []
    finished_slots: list[int] = []
    tag_page_ids: list[int] = []
    tag_values: list[int] = []
    bitmask_rows: list[int] = []
    bitmask: bytes = b""
    previous_rows: list[int] = []
    prompt_logprob_rows: list[int] = []
    prompt_logprob_starts: list[int] = []
    prompt_logprob_counts: list[int] = []
    # The step's KV operations for every rank's half of the connectors (hearth.contracts.kv_ops).
    kv_ops: KVOps = msgspec.field(default_factory=KVOps)

    @property
    def num_rows(self) -> int:
        return len(self.slots)


@dataclass
class TokenLogprob:
    """The logprob of one sampled (or prompt) token, and the `top` most likely alternatives (id, logprob)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None  # prompt logprobs: 1 + the tokens more likely than this one


class PageTagMismatch(msgspec.Struct, array_like=True):
    """One page table entry whose page does not carry the tag the row expects.

    `row` is the step row, `page_index` the entry's place in the row's table (its logical page),
    `page_id` the physical page it names, `expected_tag` what the request recorded, `found_tag` the pool's
    (`PADDING_TAG` when `page_id` names no page of the pool at all).
    """

    row: int
    page_index: int
    page_id: int
    expected_tag: int
    found_tag: int


class StepOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """Per sampled row of the step, in row order: the tokens it keeps (one for a row without drafts,
    1..1+k for a row with k), and their logprobs when any row of the step asked for them (an empty list
    for rows that did not). `kv_mismatches`: page table entries that failed the integrity check (their rows
    did not run: an empty token list). `draft_token_ids`: per sampled row, drafts a proposer's worker half
    made for the next step (empty when none ran)."""

    sampled_token_ids: list[list[int]]
    logprobs: list[list[TokenLogprob]] | None = None
    kv_mismatches: list[PageTagMismatch] = []
    draft_token_ids: list[list[int]] = []
    # Per scored prompt position of the step's kept `prompt_logprob_rows`, in order (rows that failed the
    # integrity check have none); None when the step scored none.
    prompt_logprobs: list[TokenLogprob] | None = None
    # What the ranks' KV connector halves finished (hearth.contracts.kv_ops), every rank's, on rank 0.
    kv_events: list[KVEvent] = []
