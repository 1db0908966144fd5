"""Tool-call parsers by name (`--tool-call-parser NAME`)."""

from __future__ import annotations

from collections.abc import Callable

from hearth.server.tool_parsers.base import ToolParser

_PARSERS: dict[str, type[ToolParser]] = {}


def register_tool_parser(name: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
    def register(cls: type[ToolParser]) -> type[ToolParser]:
        if name in _PARSERS:
            raise ValueError(f"tool parser {name!r} is registered twice")
        _PARSERS[name] = cls
        return cls

    return register


def available_tool_parsers() -> list[str]:
    return sorted(_PARSERS)


def get_tool_parser(name: str) -> ToolParser:
    if name not in _PARSERS:
        raise KeyError(
            f"unknown tool-call parser {name!r}; choose one of {', '.join(available_tool_parsers())}"
        )
    return _PARSERS[name]()
