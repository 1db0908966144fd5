"""Mistral: `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}` calls (tokenizers before v11), or
`[TOOL_CALLS]NAME[ARGS]{...}` once per call (v11 and later). Text before the first marker is content."""

from __future__ import annotations

from hearth.server.tool_parsers.base import ParsedToolCall, ToolParser, ToolParseResult, hold_back
from hearth.server.tool_parsers.json_calls import json_call_sequence

_CALLS = "[TOOL_CALLS]"
_ARGS = "[ARGS]"
_HELD = " \t\r\n"


class MistralToolParser(ToolParser):
    name = "mistral"
    needs_special_tokens = True

    def parse(self, text: str, final: bool) -> ToolParseResult:
        first = text.find(_CALLS)
        if first == -1:
            return ToolParseResult(text if final else hold_back(text, (_CALLS,)))
        content = text[:first]
        calls: list[ParsedToolCall] = []
        segments = text[first + len(_CALLS) :].split(_CALLS)
        for k, segment in enumerate(segments):
            last = k == len(segments) - 1
            closed = final or not last
            if not closed:
                segment = hold_back(segment, (_CALLS,))
            stripped = segment.lstrip()
            if stripped.startswith(("[", "{")):
                found, _, _ = json_call_sequence(stripped.lstrip("["), ",]", closed)
                calls.extend(found)
                continue
            name, sep, arguments = segment.partition(_ARGS)
            if not sep:
                if not closed:
                    segment = hold_back(segment, (_ARGS,))
                if closed and segment.strip():
                    calls.append(ParsedToolCall(segment.strip(), "{}"))
                continue
            calls.append(
                ParsedToolCall(
                    name.strip(), arguments.strip() if closed else arguments.lstrip().rstrip(_HELD)
                )
            )
        return ToolParseResult(content, calls)
