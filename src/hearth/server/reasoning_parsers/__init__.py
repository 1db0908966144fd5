"""Reasoning parsers (`--reasoning-parser NAME`): split a model's thinking from its answer. The built-in
formats are lazy entries of `base.REASONING_PARSERS`."""

from hearth.server.reasoning_parsers.base import (
    REASONING_PARSERS,
    ReasoningExtractor,
    ReasoningParser,
    ReasoningResult,
    available_reasoning_parsers,
    get_reasoning_parser,
    register_reasoning_parser,
)

__all__ = [
    "REASONING_PARSERS",
    "ReasoningExtractor",
    "ReasoningParser",
    "ReasoningResult",
    "available_reasoning_parsers",
    "get_reasoning_parser",
    "register_reasoning_parser",
]
