"""Prompt logprobs (`prompt_logprobs`, `echo` + `logprobs`): the logprob of every prompt token but the first,
given the tokens before it, and the top-k alternatives at each position.

Kept apart from the step loop so it can be re-applied on any step/worker layout (issue 27):
- engine side, `plan`: after the step is built, the positions of each prefill chunk whose next token is a
  prompt token become extra logits rows (`StepInput.prompt_logits_indices`), with the token each predicts;
- worker side, `compute`: the log-softmax of those rows (the raw logits, as vLLM reports), gathered;
- engine side, `collect`: each request's entries, appended in position order on the request, sent once
  with its first output.

A request that asks for them never reads the prefix cache (cached tokens are not computed, so they would
have no logits); its own pages still enter the cache for others.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from hearth.engine.outputs import TokenLogprob

if TYPE_CHECKING:
    from hearth.engine.request import Request
    from hearth.engine.scheduler import ScheduledRequest
    from hearth.engine.step_input import StepInput

# Rows of log-softmax at a time: a 2k-token chunk over a 150k vocabulary would otherwise be 1.2 GB at once.
_BLOCK_ROWS = 256

PromptPlan = list[tuple["Request", int, int]]  # (request, first prompt position, entries) per chunk


def wants_prompt_logprobs(request: Request) -> bool:
    return request.params.prompt_logprobs is not None


def plan(step: StepInput, scheduled: Sequence[ScheduledRequest]) -> PromptPlan:
    """Adds the prompt positions of this step's chunks to `step`; what `collect` needs to file the results."""
    chunks: PromptPlan = []
    indices: list[int] = []
    targets: list[int] = []
    num_top = 0
    starts = step.query_start_loc
    for row, item in enumerate(scheduled):
        request = item.request
        if request.params.prompt_logprobs is None or request.prompt_logprobs_sent:
            continue
        start = request.num_computed_tokens
        # Position p's logits predict token p + 1: the prompt's tokens 1 .. n-1 come from positions 0 .. n-2.
        end = min(start + item.num_new_tokens, request.num_prompt_tokens - 1)
        first = max(start, len(request.prompt_logprobs))  # a recomputed chunk adds only what is missing
        if first >= end:
            continue
        base = starts[row] - start
        indices.extend(range(base + first, base + end))
        targets.extend(request.prompt_token_ids[first + 1 : end + 1])
        num_top = max(num_top, request.params.prompt_logprobs)
        chunks.append((request, first, end - first))
    step.prompt_logits_indices = indices
    step.prompt_logprob_token_ids = targets
    step.prompt_logprob_top = num_top
    return chunks


def collect(chunks: PromptPlan, entries: list[TokenLogprob] | None) -> None:
    """Files the worker's entries (in plan order) on their requests."""
    if not chunks or entries is None:
        return
    offset = 0
    for request, first, count in chunks:
        if first == len(request.prompt_logprobs):
            request.prompt_logprobs.extend(entries[offset : offset + count])
        offset += count


def take(request: Request) -> list[TokenLogprob] | None:
    """The request's prompt logprobs, once: with its first output."""
    if request.params.prompt_logprobs is None or request.prompt_logprobs_sent:
        return None
    request.prompt_logprobs_sent = True
    return request.prompt_logprobs


def compute(logits: torch.Tensor, token_ids: list[int], num_top: int, vocab_size: int) -> list[TokenLogprob]:
    """Per row of `logits`: the logprob and rank of `token_ids[row]`, and the `num_top` most likely tokens."""
    entries: list[TokenLogprob] = []
    targets = torch.tensor(token_ids, dtype=torch.long, device=logits.device)
    for begin in range(0, logits.shape[0], _BLOCK_ROWS):
        block = torch.log_softmax(logits[begin : begin + _BLOCK_ROWS, :vocab_size].float(), dim=-1)
        wanted = targets[begin : begin + _BLOCK_ROWS]
        chosen = block.gather(1, wanted[:, None])
        ranks = (block > chosen).sum(dim=-1) + 1
        top_values: list[list[float]] = [[] for _ in range(block.shape[0])]
        top_ids: list[list[int]] = [[] for _ in range(block.shape[0])]
        if num_top > 0:
            values, ids = block.topk(num_top, dim=-1)
            top_values, top_ids = values.tolist(), ids.tolist()
        for token_id, logprob, rank, values_row, ids_row in zip(
            wanted.tolist(), chosen.squeeze(1).tolist(), ranks.tolist(), top_values, top_ids, strict=True
        ):
            entries.append(TokenLogprob(token_id, logprob, list(zip(ids_row, values_row, strict=True)), rank))
    return entries
