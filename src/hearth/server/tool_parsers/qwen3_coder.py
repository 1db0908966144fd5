"""Qwen3-Coder XML calls:

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

Values are bare text, typed by the tool's schema (strings stay strings, the rest is read as JSON). Arguments
stream one parameter at a time."""

from __future__ import annotations

import re

from hearth.server.tool_parsers.base import (
    ParsedToolCall,
    TaggedToolParser,
    TypedArgumentsMixin,
    arguments_object,
)

_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


class Qwen3CoderToolParser(TypedArgumentsMixin, TaggedToolParser):
    name = "qwen3_coder"
    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def parse_body(self, body: str, closed: bool) -> ParsedToolCall | None:
        match = _FUNCTION.match(body)
        if match is None:
            return None
        function = match.group(1).strip()
        pairs = []
        pos = match.end()
        while (parameter := _PARAMETER.match(body, pos)) is not None:
            key = parameter.group(1).strip()
            pairs.append((key, self.typed_value(function, key, parameter.group(2))))
            pos = parameter.end()
        done = closed or "</function>" in body[pos:]
        return ParsedToolCall(function, arguments_object(pairs, done))

    def forced_prefix(self, function_name: str | None) -> str | None:
        if function_name is None:
            return "<tool_call>\n<function="
        return f"<tool_call>\n<function={function_name}>\n"

    def call_end_stop(self) -> str | None:
        return self.end_tag
