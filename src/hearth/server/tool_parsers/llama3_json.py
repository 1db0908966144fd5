"""Llama 3.x JSON tool calls: the whole answer is `{"name": ..., "parameters": {...}}` objects separated by `;`,
optionally after `<|python_tag|>`. An answer that starts otherwise is plain content."""

from __future__ import annotations

from hearth.server.tool_parsers.base import ToolParser, ToolParseResult
from hearth.server.tool_parsers.json_calls import json_call_sequence

_PYTHON_TAG = "<|python_tag|>"


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
        calls, stop, undecided = json_call_sequence(body, ";", final)
        if undecided:
            return ToolParseResult("", calls)
        rest = body[stop:]
        if not calls:
            # Nothing that reads as a call: the whole answer is content, once that is certain.
            return ToolParseResult(text if final or rest.strip() else "", calls)
        return ToolParseResult(rest if final else "", calls)
