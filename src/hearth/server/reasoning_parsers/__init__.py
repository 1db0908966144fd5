"""Reasoning parsers (`--reasoning-parser NAME`): split a model's thinking from its answer. Importing this
package registers the built-in formats."""

from hearth.server.reasoning_parsers import harmony, think  # noqa: F401  (registration)
from hearth.server.reasoning_parsers.base import (
    ReasoningExtractor,
    ReasoningParser,
    ReasoningResult,
    available_reasoning_parsers,
    get_reasoning_parser,
    register_reasoning_parser,
)

__all__ = [
    "ReasoningExtractor",
    "ReasoningParser",
    "ReasoningResult",
    "available_reasoning_parsers",
    "get_reasoning_parser",
    "register_reasoning_parser",
]
