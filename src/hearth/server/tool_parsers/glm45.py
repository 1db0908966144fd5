"""GLM-4.5/4.6: `<tool_call>NAME\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>...</tool_call>`.

Arguments stream one key at a time: each finished `<arg_value>` adds `"k": v` to the arguments object."""

from __future__ import annotations

import re

from hearth.server.tool_parsers.base import (
    ParsedToolCall,
    TaggedToolParser,
    TypedArgumentsMixin,
    arguments_object,
)

_ARG = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
_NAME = re.compile(r"^\s*([^\s<]+)(?=\s|<)")


class Glm45ToolParser(TypedArgumentsMixin, TaggedToolParser):
    name = "glm45"
    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def parse_body(self, body: str, closed: bool) -> ParsedToolCall | None:
        match = _NAME.match(body) or (re.match(r"^\s*([^\s<]+)\s*$", body) if closed else None)
        if match is None:
            return None
        function = match.group(1)
        pairs = []
        pos = match.end()
        while (arg := _ARG.match(body, pos)) is not None:
            pairs.append(
                (arg.group(1).strip(), self.typed_value(function, arg.group(1).strip(), arg.group(2)))
            )
            pos = arg.end()
        return ParsedToolCall(function, arguments_object(pairs, done=closed))
