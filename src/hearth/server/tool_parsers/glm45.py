"""GLM-4.5/4.6: `<tool_call>NAME\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>...</tool_call>`."""

from __future__ import annotations

import json
import re

from hearth.server.tool_parsers.base import ParsedToolCall, TaggedToolParser
from hearth.server.tool_parsers.registry import register_tool_parser

_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
_NAME = re.compile(r"^\s*([^\s<]+)\s*")


@register_tool_parser("glm45")
class Glm45ToolParser(TaggedToolParser):
    name = "glm45"
    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def parse_body(self, body: str) -> ParsedToolCall | None:
        match = _NAME.match(body)
        if match is None:
            return None
        rest = body[match.end() :]
        arguments = {}
        for key, raw in _ARG.findall(rest):
            # Values are written bare; numbers, booleans and objects are JSON, anything else is a string.
            try:
                arguments[key.strip()] = json.loads(raw)
            except json.JSONDecodeError:
                arguments[key.strip()] = raw
        if _ARG.sub("", rest).strip():
            return None  # text that is not an argument: not a call we understand
        return ParsedToolCall(match.group(1), json.dumps(arguments, ensure_ascii=False))
