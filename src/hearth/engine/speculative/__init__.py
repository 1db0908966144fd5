"""Speculative decoding: proposers (`ngram`, `draft`, `eagle3`) guess the next tokens of running requests, the
target verifies them in one multi-token row (`Scheduler._add_drafts`), and the worker keeps what it accepts
(greedy: the agreeing run; sampled: rejection sampling, `hearth.engine.speculative.rejection`).

`Speculator` is what the engine holds: it asks the proposer for drafts before each schedule, sizes them per
request from recent acceptance (adaptive K), and counts what was proposed and accepted for /metrics.
"""

from hearth.engine.speculative.proposer import ProposalRequest, Proposer
from hearth.engine.speculative.registry import build_proposer, check_speculative_options, register_proposer
from hearth.engine.speculative.speculator import SpecStats, Speculator

__all__ = [
    "Proposer",
    "ProposalRequest",
    "SpecStats",
    "Speculator",
    "build_proposer",
    "check_speculative_options",
    "register_proposer",
]
