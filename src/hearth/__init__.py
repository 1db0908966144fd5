"""Hearth: an LLM inference server for agent traffic."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from hearth.engine.llm import LLM
    from hearth.engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy, so `hearth route` and `hearth bench serve` never pay torch's import time.
    if name == "LLM":
        from hearth.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from hearth.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
