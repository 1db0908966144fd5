"""What the engine holds for speculative decoding: drafts before each schedule, adaptive K, counters.

Adaptive K: each request keeps a moving average of how many of its drafts the target accepted per step.
It is proposed that average + 2 tokens (at most `--num-speculative-tokens`), so a request copying a JSON
envelope climbs to the maximum within a step or two and one writing prose settles low; a request whose
drafts keep failing (average acceptance rate below `_OFF_RATE`) stops proposing for `_COOLDOWN_STEPS`
steps, then tries again with K=1. The whole step goes without drafts when more decode rows run than
`--speculative-max-batch-size`: verification costs the target a token per draft, and in a large batch
the matmuls are no longer free to widen.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hearth.engine.request import Request
from hearth.engine.spec.proposer import ProposalRequest, Proposer

_EMA_WEIGHT = 0.5  # weight of the newest step in the averages
_OFF_RATE = 0.15
_COOLDOWN_STEPS = 16


@dataclass
class SpecStats:
    """Counters for /metrics and `hearth bench` (totals since start)."""

    method: str
    num_drafts: int = 0  # verified rows that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verified row yields on average: accepted drafts + the token sampled after them."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass
class _Acceptance:
    mean_accepted: float
    rate: float = 1.0
    num_observed: int = 0
    cooldown_steps: int = 0


@dataclass
class Speculator:
    proposer: Proposer
    max_num_tokens: int
    max_batch_size: int
    adaptive: bool = True
    stats: SpecStats = field(init=False)
    _acceptance: dict[str, _Acceptance] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.stats = SpecStats(self.proposer.name)

    def propose(self, running: list[Request]) -> None:
        """Set `draft_token_ids` of the running requests that decode next step (the scheduler picks them up)."""
        decoding = [r for r in running if r.num_tokens - r.num_computed_tokens == 1]
        for request in running:
            if request.draft_token_ids:
                request.draft_token_ids = []
        if not decoding or len(decoding) > self.max_batch_size:
            return
        batch: list[ProposalRequest] = []
        targets: list[Request] = []
        for request in decoding:
            # Room for drafts: the row samples one token anyway and must stay within max_tokens.
            room = request.max_output_tokens - len(request.output_token_ids) - 1
            num_tokens = min(self._num_tokens(request.request_id), room)
            if num_tokens <= 0:
                continue
            batch.append(
                ProposalRequest(request.request_id, request.token_ids, request.num_prompt_tokens, num_tokens)
            )
            targets.append(request)
        if not batch:
            return
        for request, drafts in zip(targets, self.proposer.propose(batch), strict=True):
            request.draft_token_ids = drafts

    def _num_tokens(self, request_id: str) -> int:
        if not self.adaptive:
            return self.max_num_tokens
        state = self._acceptance.get(request_id)
        if state is None:
            return self.max_num_tokens
        if state.cooldown_steps > 0:
            state.cooldown_steps -= 1
            return 1 if state.cooldown_steps == 0 else 0
        return max(1, min(self.max_num_tokens, int(state.mean_accepted) + 2))

    def observe(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """A verified row: `num_accepted` of its `num_drafts` drafts were kept by the target."""
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += num_accepted
        state = self._acceptance.get(request_id)
        if state is None:
            state = self._acceptance[request_id] = _Acceptance(mean_accepted=float(num_accepted))
        else:
            state.mean_accepted += _EMA_WEIGHT * (num_accepted - state.mean_accepted)
        state.rate += _EMA_WEIGHT * (num_accepted / num_drafts - state.rate)
        state.num_observed += 1
        if state.num_observed >= 3 and state.rate < _OFF_RATE:
            state.cooldown_steps = _COOLDOWN_STEPS
            state.rate = _OFF_RATE  # one good probe after the cooldown brings it back
            state.num_observed = 0

    def request_finished(self, request_id: str) -> None:
        self._acceptance.pop(request_id, None)
        self.proposer.request_finished(request_id)
