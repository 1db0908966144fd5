"""Tool-call parsers (`--tool-call-parser NAME`). Importing this package registers the built-in formats."""

from hearth.server.tool_parsers import (  # noqa: F401  (registration)
    deepseek_v3,
    glm45,
    hermes,
    kimi_k2,
    llama3_json,
    mistral,
    openai_harmony,
    pythonic,
    qwen3_coder,
)
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
