"""Tool-call parsers (`--tool-call-parser NAME`), by name in `registry.TOOL_PARSERS`."""

from hearth.server.tool_parsers.base import ParsedToolCall, ToolParser, ToolParseResult
from hearth.server.tool_parsers.registry import (
    TOOL_PARSERS,
    available_tool_parsers,
    get_tool_parser,
    register_tool_parser,
)

__all__ = [
    "TOOL_PARSERS",
    "ParsedToolCall",
    "ToolParseResult",
    "ToolParser",
    "available_tool_parsers",
    "get_tool_parser",
    "register_tool_parser",
]
