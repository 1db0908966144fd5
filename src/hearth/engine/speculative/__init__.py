"""Speculative decoding: proposers (`ngram`, `draft`, `eagle3`) guess the next tokens of running requests, the
target verifies them in one multi-token row (`Scheduler._add_drafts`), and the worker keeps what it accepts
(greedy: the agreeing run; sampled: rejection sampling, `hearth.engine.speculative.rejection`).

`Speculator` is what the engine holds: it asks the proposer for drafts before each schedule, sizes them per
request from recent acceptance (adaptive K), and counts what was proposed and accepted for /metrics.

`registry.PROPOSERS` names the methods. The package imports its parts on first use: the config reads the
registry without importing torch, which the speculator (through the scheduler) does.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hearth.engine.speculative.proposer import ProposalRequest, Proposer
    from hearth.engine.speculative.registry import (
        PROPOSERS,
        build_proposer,
        check_speculative_options,
        register_proposer,
    )
    from hearth.engine.speculative.speculator import SpecStats, Speculator

_EXPORTS = {
    "Proposer": "proposer",
    "ProposalRequest": "proposer",
    "PROPOSERS": "registry",
    "build_proposer": "registry",
    "check_speculative_options": "registry",
    "register_proposer": "registry",
    "SpecStats": "speculator",
    "Speculator": "speculator",
}

__all__ = [
    "PROPOSERS",
    "Proposer",
    "ProposalRequest",
    "SpecStats",
    "Speculator",
    "build_proposer",
    "check_speculative_options",
    "register_proposer",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
