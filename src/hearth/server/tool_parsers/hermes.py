"""Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call."""

from __future__ import annotations

import json

from hearth.server.tool_parsers.base import ParsedToolCall, TaggedToolParser
from hearth.server.tool_parsers.json_calls import json_call


class HermesToolParser(TaggedToolParser):
    name = "hermes"
    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def parse_body(self, body: str, closed: bool) -> ParsedToolCall | None:
        return json_call(body, closed)

    def __init__(self) -> None:
        self._opening = "<tool_call>\n"  # Qwen's spacing; templates that write calls without it override

    def adapt_to_template(self, template_source: str) -> None:
        # A forced call should look exactly like the calls the model was trained on.
        if "<tool_call>" in template_source:
            newline = "<tool_call>\n" in template_source or "<tool_call>\\n" in template_source
            self._opening = "<tool_call>\n" if newline else "<tool_call>"

    def forced_prefix(self, function_name: str | None) -> str | None:
        if function_name is None:
            return self._opening + '{"name": "'
        return self._opening + '{"name": ' + json.dumps(function_name) + ', "arguments": '

    def call_end_stop(self) -> str | None:
        return self.end_tag
