"""Tool-call parsers. Importing this package registers the built-in formats."""

from hearth.server.tool_parsers import glm45, hermes, kimi_k2, llama3_json  # noqa: F401  (registration)
from hearth.server.tool_parsers.base import ParsedToolCall, ToolParser, ToolParseResult
from hearth.server.tool_parsers.registry import available_tool_parsers, get_tool_parser, register_tool_parser

__all__ = [
    "ParsedToolCall",
    "ToolParseResult",
    "ToolParser",
    "available_tool_parsers",
    "get_tool_parser",
    "register_tool_parser",
]
