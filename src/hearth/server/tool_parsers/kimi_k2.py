"""Kimi K2: `<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{...}<|tool_call_end|>` inside a
`<|tool_calls_section_begin|>` ... `<|tool_calls_section_end|>` section. The markers are special tokens."""

from __future__ import annotations

import re

from hearth.server.tool_parsers.base import ParsedToolCall, TaggedToolParser

_ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
_CALL_ID = re.compile(r"^\s*(?:functions\.)?(?P<name>[^:\s]+)(?::\d+)?\s*$")


class KimiK2ToolParser(TaggedToolParser):
    name = "kimi_k2"
    needs_special_tokens = True
    start_tag = "<|tool_call_begin|>"
    end_tag = "<|tool_call_end|>"
    ignored_markers = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")
    inner_markers = (_ARGUMENT_BEGIN,)

    def parse_body(self, body: str, closed: bool) -> ParsedToolCall | None:
        call_id, sep, arguments = body.partition(_ARGUMENT_BEGIN)
        match = _CALL_ID.match(call_id)
        if not sep or match is None:
            return None
        return ParsedToolCall(
            match["name"], arguments.strip() if closed else arguments.lstrip().rstrip(), id=call_id.strip()
        )
