"""Tool-call parsers by name (`--tool-call-parser NAME`): one lazy `"module:Class"` line per format, so the
CLI lists the names without importing a parser."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from hearth.contracts.registry import Registry

if TYPE_CHECKING:
    from hearth.server.tool_parsers.base import ToolParser

TOOL_PARSERS: Registry[type[ToolParser]] = Registry("tool-call parser")
TOOL_PARSERS.add("deepseek_v3", "hearth.server.tool_parsers.deepseek_v3:DeepSeekV3ToolParser")
TOOL_PARSERS.add("glm45", "hearth.server.tool_parsers.glm45:Glm45ToolParser")
TOOL_PARSERS.add("hermes", "hearth.server.tool_parsers.hermes:HermesToolParser")
TOOL_PARSERS.add("kimi_k2", "hearth.server.tool_parsers.kimi_k2:KimiK2ToolParser")
TOOL_PARSERS.add("llama3_json", "hearth.server.tool_parsers.llama3_json:Llama3JsonToolParser")
TOOL_PARSERS.add("mistral", "hearth.server.tool_parsers.mistral:MistralToolParser")
TOOL_PARSERS.add("openai", "hearth.server.tool_parsers.openai_harmony:HarmonyToolParser")
TOOL_PARSERS.add("pythonic", "hearth.server.tool_parsers.pythonic:PythonicToolParser")
TOOL_PARSERS.add("qwen3_coder", "hearth.server.tool_parsers.qwen3_coder:Qwen3CoderToolParser")


def register_tool_parser(name: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
    """Class decorator for a parser defined outside this package."""
    return TOOL_PARSERS.register(name)


def available_tool_parsers() -> list[str]:
    return list(TOOL_PARSERS.names())


def get_tool_parser(name: str) -> ToolParser:
    """A new parser for `name`; an UnknownNameError naming the known ones otherwise."""
    return TOOL_PARSERS.get(name)()
