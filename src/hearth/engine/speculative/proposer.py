"""The proposer interface, in two halves: the scheduler half decides, the worker half computes.

Speculative decoding is propose -> verify. Where the guesses come from decides where the code runs:

- **Scheduler half** (`Proposer`, in the engine core, rank 0; plain Python, no tensors): for each running
  request it decides *how many* tokens to draft (the `Speculator` sizes K from recent acceptance) and, for a
  proposer that needs only token ids (n-gram, suffix decoding), *which* tokens: `propose(batch)`. It sees
  requests, never a model or a KV pool.
- **Worker half** (`ProposerWorker`, one per rank, built by the rank's `Worker`): runs whatever needs tensors
  (a draft model, an EAGLE-3 or MTP head) on *its own rank's shard*, next to the target's shard, reading the
  target's hidden states from its own rank (never from another process). Every rank runs the same worker
  half in lock-step (the collectives of a TP draft model require it); the sampling rank's drafts are the
  ones that count.

The protocol (`hearth.contracts.step`):

1. A step's rows carry the drafts to verify (`StepInput.num_draft_tokens` per row, flattened in
   `draft_token_ids`), wherever they came from.
2. A proposer with a worker half also needs, per row, how many tokens to draft *after* this step: that is
   one more per-row list in `StepInput` (`num_propose_tokens`, to be added with the first worker half; 0 or
   absent: none). The worker verifies (greedy: the agreeing run; sampled: rejection sampling), then calls
   its worker half with the rows that asked, and returns the drafts in `StepOutput.draft_token_ids` (per
   sampled row, in row order; `[]` where none were asked or none could be made).
3. The engine core puts them in `request.draft_token_ids` for the next step (cut to what still fits), where
   they are verified exactly like a scheduler-half proposal. A proposal is only a guess: a wrong or missing
   draft costs time, never a token (token-exactness does not depend on the proposer).

Today's built-in proposers: `ngram` and `suffix` are scheduler-only (it needs token ids alone); `draft` and `eagle3` run
whole on rank 0 inside the scheduler half (`hearth.parallel.state.single_rank`), beside rank 0's shard of
the target, which composes with tensor parallelism (the residual stream EAGLE-3 reads is whole on every TP
rank) and, for `draft`, with pipeline parallelism. A sharded draft model or an MTP head on every rank is
what the worker half above is for.

Contract of the scheduler half (`Proposer`):
- `propose(batch)` returns, per request in order, at most `num_tokens` token ids (may be fewer or none).
  Proposals are deterministic given the request's tokens (a proposal distribution that is one-hot), which is
  what the rejection sampler assumes. A proposer with a worker half returns `[]` here and sets
  `has_worker_half = True`; the engine then asks the worker for `num_tokens` instead.
- Between calls the target may keep any prefix of the previous proposal: a proposer holding state per
  request (a draft model's KV) reconciles with `token_ids` itself.
- `request_finished(request_id)` drops that state; it is called once for every request that ends,
  after `request_done` (its final tokens, for proposers that learn from earlier answers: `suffix`).

Contract of the worker half (`ProposerWorker`):
- `after_target_forward(batch, hidden)`: called by the worker after every target forward with the step's
  flattened batch and the target's auxiliary hidden states for its tokens (None when it asked for none);
  keeps what it needs per request (EAGLE-3: the states of the positions the target kept).
- `propose(requests) -> list[list[int]]`: for `(request_id, token_ids, num_tokens)` of the rows that asked
  for drafts, at most `num_tokens` ids each; deterministic given its inputs, identical on every rank.
- `request_finished(request_id)`: drop the request's state (the worker calls it for each finished id).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class ProposalRequest:
    """One request to propose for: every token it has (prompt + output) and how many to guess."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    num_tokens: int  # how many to propose (>= 1)
    # Whose request it is (the prefix-cache root, covering `cache_salt`): proposers that learn across
    # requests (`suffix`) keep what they learn per tenant.
    tenant: bytes = b""


class Proposer(ABC):
    """Guesses the next tokens of requests; the target verifies them, so a wrong guess costs time, not output.

    Contract:
    - `propose(batch)` returns, per request in order, at most `num_tokens` token ids (may be fewer or none).
      Proposals are deterministic given the request's tokens (a proposal distribution that is one-hot),
      which is what the rejection sampler assumes.
    - Between calls the target may keep any prefix of the previous proposal: a proposer holding state per
      request (a draft model's KV) reconciles with `token_ids` itself.
    - `request_finished(request_id)` drops that state; it is called once for every request that ends,
      after `request_done` (its final tokens, for proposers that learn from earlier answers).
    """

    name: str = "?"
    # True when the drafts come from a `ProposerWorker` on every rank (draft model, EAGLE-3, MTP): the engine
    # asks the worker for `num_tokens` per request instead of calling `propose` for tokens.
    has_worker_half: bool = False
    # True: drafts are as long as the proposer is confident (up to `num_tokens`), so the speculator offers
    # the full K rather than a K grown from recent acceptance.
    sizes_own_drafts: bool = False

    @abstractmethod
    def propose(self, batch: list[ProposalRequest]) -> list[list[int]]: ...

    def target_step_done(self, batch: list[Any]) -> None:  # noqa: B027 (most proposers read nothing of it)
        """The target ran a step over `batch` (`ScheduledRequest`s, outputs already applied to the requests)."""

    def request_done(self, request: ProposalRequest) -> None:  # noqa: B027 (most learn nothing across requests)
        """The request ended with `request.token_ids` (prompt + answer); called before `request_finished`."""

    def request_finished(self, request_id: str) -> None:  # noqa: B027 (stateless proposers keep nothing)
        """Drop whatever is kept for the request."""


class ProposerWorker(ABC):
    """The worker half of a proposer: models on this rank's shard (see the module docstring's contract)."""

    name: str = "?"

    def after_target_forward(self, batch: Any, hidden: Any) -> None:  # noqa: B027 (optional)
        """The target ran `batch` (a flattened step) on this rank; `hidden`: its aux hidden states or None."""

    @abstractmethod
    def propose(self, requests: list[ProposalRequest]) -> list[list[int]]: ...

    def request_finished(self, request_id: str) -> None:  # noqa: B027 (stateless halves keep nothing)
        """Drop whatever is kept for the request."""
