"""What a worker's model runs each step: `ForwardBatch`, the step's rows flattened into plain lists.

A worker builds it from its persistent batch and the step's deltas (`hearth.engine.persistent_batch`);
proposers build their own for their models' forwards (`hearth.engine.speculative.paged_rows`). Rows:
a row computes `tokens[c : c + num_new_tokens - len(drafts)] + drafts` at positions
`c .. c + num_new_tokens - 1`; a row that samples gets 1 + len(drafts) logits positions, its last known
token and each draft.
"""

from __future__ import annotations

import msgspec

from hearth.contracts.sampling import SamplerParams


class StepSamplingRow(msgspec.Struct, array_like=True, omit_defaults=True):
    """One sampled row: its request, parameters, the drafts to verify, and what penalties need.

    `prompt_token_ids`/`output_token_ids` are sent only for rows with penalties (they are the whole
    history); `num_output_tokens` (generated before this step) is always there, for `min_tokens`.
    """

    request_id: str
    params: SamplerParams
    num_output_tokens: int
    draft_token_ids: list[int] = []
    prompt_token_ids: list[int] | None = None
    output_token_ids: list[int] | None = None

    @property
    def num_logits(self) -> int:
        return 1 + len(self.draft_token_ids)


class ForwardBatch(msgspec.Struct, omit_defaults=True):
    """One step's flat batch. Rows in batch order; the first `num_decode_rows` have one query token each.

    - `token_ids`, `positions`, `slot_mapping`: per token of the flat batch (slot = page * page_size + offset).
    - `query_start_loc` (num_rows + 1, cu_seqlens) and `seq_lens` (context length per row after this step).
    - `page_table`: row-major `[num_rows, page_table_width]`; row r's first ceil(seq_lens[r] / page_size)
      entries are its pages in position order, the rest is padding (page 0).
    - `page_tags`: the generation tag expected of every page a row reads, laid out like `page_table`
      (padding entries `PADDING_TAG`), for the integrity check; empty when checking is off.
    - `logits_indices`: flat-batch rows whose logits are sampled, 1 + len(drafts) consecutive ones per
      sampled row, in `sampling` order.
    - `bitmask_rows`/`bitmask`: grammar masks, as indices into `logits_indices` (a constrained row with
      drafts has one per position its grammar reaches) and their little-endian int32 words
      (`len(bitmask_rows)` rows of equal width; bit t allows token t). Bytes, not a list: a 150k vocabulary
      is 4.7k words a row, copied once instead of boxed as Python ints.
    - `prompt_logits_indices`: prompt logprobs (`hearth.engine.prompt_logprobs`): flat-batch rows whose
      logits score the next prompt token (after the sampled ones in the forward's logits), that token
      (`prompt_logprob_token_ids`), and how many top alternatives the most demanding row wants.
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
    bitmask_rows: list[int] = []
    bitmask: bytes = b""
    prompt_logits_indices: list[int] = []
    prompt_logprob_token_ids: list[int] = []
    prompt_logprob_top: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_rows(self) -> int:
        return len(self.seq_lens)
