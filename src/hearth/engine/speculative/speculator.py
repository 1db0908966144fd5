"""What the engine holds for speculative decoding: drafts before each schedule, adaptive K, counters.

Adaptive K: each request keeps a moving average of how many of its drafts the target accepted per step.
It is proposed that average + 2 tokens (at most `--num-speculative-tokens`), so a request copying a JSON
envelope climbs to the maximum within a step or two and one writing prose settles low; a request whose
drafts keep failing (average acceptance rate below `_OFF_RATE`) stops proposing for `_COOLDOWN_STEPS`
steps, then tries again with K=1. The whole step goes without drafts when more decode rows run than
`--speculative-max-batch-size`: verification costs the target a token per draft, and in a large batch
the matmuls are no longer free to widen.

Below that size, whether speculation pays, and how many drafts a row may carry, is measured, not assumed
(`Payoff`): per decode batch size (powers of two), the wall seconds per output token of pure-decode steps
under each draft cap (none, a quarter of K, K); the cheapest cap is used, and the others are measured again
in turn every `_EXPLORE_EVERY_STEPS` steps, so a draft model that costs more than it saves (a small target, a
busy CPU, a large batch) switches itself off, and a batch size where a verify row's extra queries are no
longer free settles on short drafts.

A proposer that sizes its drafts itself (`Proposer.sizes_own_drafts`: `suffix` drafts as far as its match
is confident) is allowed the cap whatever its recent acceptance; the cooldown still applies.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from hearth.engine.request import Request
from hearth.engine.scheduler import ScheduledRequest
from hearth.engine.speculative.proposer import ProposalRequest, Proposer

_EMA_WEIGHT = 0.5  # weight of the newest step in the averages
_OFF_RATE = 0.15
_COOLDOWN_STEPS = 16
_EXPLORE_EVERY_STEPS = 16  # how often the batch size's losing choice (drafts or none) is measured again


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


def draft_caps(max_num_tokens: int) -> tuple[int, ...]:
    """The per-row draft caps a batch size chooses between (0: no drafts), largest first."""
    return tuple(sorted({max_num_tokens, max(1, max_num_tokens // 4), 0}, reverse=True))


@dataclass
class Payoff:
    """Seconds per output token of pure-decode steps per (decode batch size bucket, draft cap)."""

    caps: tuple[int, ...] = (1, 0)  # largest first; 0 is "no drafts"
    cost_s: dict[tuple[int, int], float] = field(default_factory=dict)  # (bucket, cap) -> EMA s/token
    num_decisions: int = 0

    @staticmethod
    def bucket(num_decode_rows: int) -> int:
        return num_decode_rows.bit_length()

    def choose(self, num_decode_rows: int) -> int:
        """The draft cap for a step with this many decode rows: an unmeasured cap first (largest first),
        else the cheapest, except every `_EXPLORE_EVERY_STEPS` decisions, which re-measure the others in turn."""
        bucket = self.bucket(num_decode_rows)
        self.num_decisions += 1
        costs = [self.cost_s.get((bucket, cap)) for cap in self.caps]
        for cap, cost in zip(self.caps, costs, strict=True):
            if cost is None:
                return cap
        ranked = sorted(zip(costs, self.caps, strict=True))
        if self.num_decisions % _EXPLORE_EVERY_STEPS == 0 and len(ranked) > 1:
            turn = (self.num_decisions // _EXPLORE_EVERY_STEPS) % (len(ranked) - 1)
            return ranked[1 + turn][1]
        return ranked[0][1]

    def use_drafts(self, num_decode_rows: int) -> bool:
        return self.choose(num_decode_rows) > 0

    def record(self, num_decode_rows: int, cap: int, seconds: float, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        key = (self.bucket(num_decode_rows), int(cap))
        cost = seconds / num_tokens
        old = self.cost_s.get(key)
        self.cost_s[key] = cost if old is None else old + _EMA_WEIGHT * (cost - old)


@dataclass
class Speculator:
    proposer: Proposer
    max_num_tokens: int
    max_batch_size: int
    adaptive: bool = True
    stats: SpecStats = field(init=False)
    payoff: Payoff = field(init=False)
    _acceptance: dict[str, _Acceptance] = field(default_factory=dict)
    # This step's start, decode rows, the draft cap used, and whether its cost is a steady-state sample.
    _step: tuple[float, int, int, bool] | None = None
    # Running requests by id until they end: what `request_done` hands a proposer that learns from answers.
    _live: dict[str, Request] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.stats = SpecStats(self.proposer.name)
        self.payoff = Payoff(draft_caps(self.max_num_tokens))

    def propose(self, running: list[Request]) -> None:
        """Set `draft_token_ids` of the running requests that decode next step (the scheduler picks them up)."""
        decoding = [r for r in running if r.num_tokens - r.num_computed_tokens == 1]
        live = self._live
        for request in running:
            if request.draft_token_ids:
                request.draft_token_ids = []
            if request.request_id not in live:
                live[request.request_id] = request
        self._step = None
        if not decoding or len(decoding) > self.max_batch_size:
            return
        cap = self.payoff.choose(len(decoding)) if self.adaptive else self.max_num_tokens
        self._step = (time.perf_counter(), len(decoding), cap, True)
        if cap == 0:
            return
        batch: list[ProposalRequest] = []
        targets: list[Request] = []
        for request in decoding:
            # Room for drafts: the row samples one token anyway and must stay within max_tokens.
            room = request.max_output_tokens - len(request.output_token_ids) - 1
            num_tokens = min(self._num_tokens(request.request_id), room, cap)
            if num_tokens <= 0:
                continue
            batch.append(
                ProposalRequest(
                    request.request_id,
                    request.token_ids,
                    request.num_prompt_tokens,
                    num_tokens,
                    request.prefix_root,
                )
            )
            targets.append(request)
        if not batch:
            return
        # A request's first drafted step also pays the proposer's one-off catch-up over its context (a draft
        # model's prefill); charged to the per-token rate, it would switch drafts off at every new request.
        if any(request.request_id not in self._acceptance for request in targets):
            self._step = (self._step[0], len(decoding), cap, False)
        for request, drafts in zip(targets, self.proposer.propose(batch), strict=True):
            request.draft_token_ids = drafts

    def step_finished(self, batch: list[ScheduledRequest], num_output_tokens: int) -> None:
        """The step that `propose` began is done: record its cost if it only decoded (prefill chunks would blur it)."""
        self.proposer.target_step_done(batch)
        if self._step is None:
            return
        started, num_decode_rows, cap, steady = self._step
        self._step = None
        if steady and all(item.num_new_tokens == 1 + len(item.draft_token_ids) for item in batch):
            self.payoff.record(num_decode_rows, cap, time.perf_counter() - started, num_output_tokens)

    def _num_tokens(self, request_id: str) -> int:
        if not self.adaptive:
            return self.max_num_tokens
        state = self._acceptance.get(request_id)
        if state is None:
            return self.max_num_tokens
        if state.cooldown_steps > 0:
            state.cooldown_steps -= 1
            return 1 if state.cooldown_steps == 0 else 0
        if self.proposer.sizes_own_drafts:
            return self.max_num_tokens
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
        request = self._live.pop(request_id, None)
        if request is not None:
            self.proposer.request_done(
                ProposalRequest(
                    request_id, request.token_ids, request.num_prompt_tokens, 0, request.prefix_root
                )
            )
        self.proposer.request_finished(request_id)
