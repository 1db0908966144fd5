"""Llama 3.x JSON tool calls: the whole answer is `{"name": ..., "parameters": {...}}` objects separated by `;`,
optionally after `<|python_tag|>`. An answer that starts otherwise is plain content."""

from __future__ import annotations

import json

from hearth.server.tool_parsers.base import ParsedToolCall, ToolParser, ToolParseResult, arguments_json
from hearth.server.tool_parsers.registry import register_tool_parser

_PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


def _as_call(value: object) -> ParsedToolCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("parameters", value.get("arguments", {}))
    return ParsedToolCall(value["name"], arguments_json(arguments))


@register_tool_parser("llama3_json")
class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    needs_special_tokens = True  # <|python_tag|> is a special token

    def parse(self, text: str, final: bool) -> ToolParseResult:
        stripped = text.lstrip()
        if stripped.startswith(_PYTHON_TAG):
            body = stripped[len(_PYTHON_TAG) :]
        elif stripped.startswith("{"):
            body = stripped
        elif not final and _PYTHON_TAG.startswith(stripped):
            return ToolParseResult("")  # cannot tell yet whether this is a call
        else:
            return ToolParseResult(text)
        calls: list[ParsedToolCall] = []
        pos = 0
        while True:
            while pos < len(body) and (body[pos].isspace() or body[pos] == ";"):
                pos += 1
            if pos >= len(body):
                return ToolParseResult("", calls)
            try:
                value, end = _DECODER.raw_decode(body, pos)
            except json.JSONDecodeError:
                value, end = None, -1
            call = _as_call(value) if end != -1 else None
            if call is None:
                if not final:
                    return ToolParseResult("", calls)  # an object still being written, or not decided yet
                # Whatever does not parse stays content; with no call at all, the whole answer is content.
                return ToolParseResult(body[pos:] if calls else text, calls)
            calls.append(call)
            pos = end
