"""The speculative decoding options (`SpeculativeOptions`, a part of `EngineConfig`); the method names come
from the proposer registry, whose entries are lazy, so reading them imports no proposer or torch."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from hearth.contracts.options import not_an_option, option
from hearth.engine.speculative.registry import PROPOSERS, check_speculative_options

_option = functools.partial(option, group="speculative")


@dataclass(frozen=True)
class SpeculativeOptions:
    """Speculative decoding (`hearth.engine.speculative`): None = off."""

    speculative_method: str | None = _option(
        None,
        choices=PROPOSERS,
        help="propose tokens for the target to verify: a draft model, prompt lookup (ngram), suffix decoding "
        "over the request and its tenant's earlier answers (suffix; try --num-speculative-tokens 8), or an "
        "EAGLE-3 head",
    )
    speculative_model: str | None = _option(
        None, help="checkpoint directory of the draft model (draft, eagle3)"
    )
    num_speculative_tokens: int = _option(4, type=int, help="most tokens proposed per request and step")
    # Speculation turns itself off for a step with more decode rows than this (verification stops paying).
    # None: 8 on CPU (at batch 64 on the demo model, 8 kept speculation at 0.98-1.08x of none where 32 lost
    # 12-15%), 32 on accelerators, where a wider verify row is nearer free.
    speculative_max_batch_size: int | None = _option(
        None,
        type=int,
        help="no speculation in steps with more decode rows than this (it stops paying); "
        "default 8 on CPU, 32 on accelerators",
    )
    # vLLM's prompt_lookup_min/max (--speculative-config): the ngram lengths tried, (min, max).
    ngram_lookup: tuple[int, int] | None = not_an_option(None)

    def _check_speculative_options(self) -> None:
        if self.speculative_method is not None:
            check_speculative_options(
                self.speculative_method, self.speculative_model, self.num_speculative_tokens
            )
