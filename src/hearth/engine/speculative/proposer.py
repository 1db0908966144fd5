"""The proposer interface: given running requests and how many tokens each may get, guess them."""

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
