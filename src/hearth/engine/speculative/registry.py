"""Proposers by name (`--speculative-method`, `--speculative-config`'s `method`): one lazy line per method,
with whether it needs a draft checkpoint as metadata, so the config checks a method (and the CLI lists
them) without importing a proposer, torch or a model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hearth.contracts.registry import Registry

if TYPE_CHECKING:
    from hearth.engine.speculative.proposer import Proposer

# Each target is a builder: `build(**context) -> Proposer`.
PROPOSERS: Registry[Callable[..., Proposer]] = Registry("speculative method")
PROPOSERS.add("ngram", "hearth.engine.speculative.ngram:build", needs_model=False)
PROPOSERS.add("suffix", "hearth.engine.speculative.suffix:build", needs_model=False)
# `draft_model` is vLLM's name for the same method.
PROPOSERS.add("draft", "hearth.engine.speculative.draft:build", aliases=("draft_model",), needs_model=True)
PROPOSERS.add("eagle3", "hearth.engine.speculative.eagle3:build", needs_model=True)


def register_proposer(
    name: str, needs_model: bool
) -> Callable[[Callable[..., Proposer]], Callable[..., Proposer]]:
    """Decorator for a builder defined outside this package."""
    return PROPOSERS.register(name, needs_model=needs_model)


def check_speculative_options(method: str, model: str | None, num_tokens: int) -> None:
    """Raises ValueError naming the option to fix (EngineConfig calls it; nothing is imported or loaded).
    `method` must be a registered name, not an alias: the engine compares it by name."""
    if method not in PROPOSERS.names():
        raise ValueError(f"speculative_method must be one of {', '.join(PROPOSERS.names())}, got {method!r}")
    if num_tokens < 1:
        raise ValueError("num_speculative_tokens must be >= 1")
    needs_model = PROPOSERS.metadata(method)["needs_model"]
    if needs_model and model is None:
        raise ValueError(
            f"--speculative-method {method} needs --speculative-model DIR (the draft checkpoint)"
        )
    if needs_model and model is not None and not (Path(model) / "config.json").is_file():
        raise ValueError(f"--speculative-model {model}: no config.json there")


def build_proposer(method: str, **context: Any) -> Proposer:
    """`context`: what builders may use (config, model_config, target worker, sample vocab, ...)."""
    return PROPOSERS.get(method)(**context)
