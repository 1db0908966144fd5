"""Proposers by name (`--speculative-method`), built lazily so `ngram` never imports a model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hearth.engine.speculative.proposer import Proposer

# name -> (builder(context) -> Proposer, needs a --speculative-model)
_BUILDERS: dict[str, tuple[Callable[..., Proposer], bool]] = {}


def register_proposer(
    name: str, needs_model: bool
) -> Callable[[Callable[..., Proposer]], Callable[..., Proposer]]:
    def wrap(builder: Callable[..., Proposer]) -> Callable[..., Proposer]:
        _BUILDERS[name] = (builder, needs_model)
        return builder

    return wrap


def _load_builtin() -> None:
    # Imported here: each module registers itself; draft/eagle3 import torch and the model code.
    from hearth.engine.speculative import draft, eagle3, ngram, suffix  # noqa: F401


def check_speculative_options(method: str, model: str | None, num_tokens: int) -> None:
    """Raises ValueError naming the option to fix (EngineConfig calls it; no model is loaded)."""
    _load_builtin()
    if method not in _BUILDERS:
        raise ValueError(f"speculative_method must be one of {', '.join(sorted(_BUILDERS))}, got {method!r}")
    if num_tokens < 1:
        raise ValueError("num_speculative_tokens must be >= 1")
    needs_model = _BUILDERS[method][1]
    if needs_model and model is None:
        raise ValueError(
            f"--speculative-method {method} needs --speculative-model DIR (the draft checkpoint)"
        )
    if needs_model and model is not None and not (Path(model) / "config.json").is_file():
        raise ValueError(f"--speculative-model {model}: no config.json there")


def build_proposer(method: str, **context: Any) -> Proposer:
    """`context`: what builders may use (config, model_config, target worker, sample vocab, ...)."""
    _load_builtin()
    return _BUILDERS[method][0](**context)
