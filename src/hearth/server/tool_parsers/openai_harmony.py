"""gpt-oss tool calls in the Harmony format: a message with a `to=functions.NAME` recipient is a call, its
body the arguments; `final` (and recipient-less `commentary`) messages are content; `analysis` is reasoning
(see the `openai_gptoss` reasoning parser) and never content."""

from __future__ import annotations

from hearth.server.harmony import is_harmony, split_messages
from hearth.server.tool_parsers.base import ParsedToolCall, ToolParser, ToolParseResult


class HarmonyToolParser(ToolParser):
    name = "openai"
    needs_special_tokens = True

    def parse(self, text: str, final: bool) -> ToolParseResult:
        harmony = is_harmony(text, final)
        if harmony is None:
            return ToolParseResult("")
        if not harmony:
            return ToolParseResult(text)
        content: list[str] = []
        calls: list[ParsedToolCall] = []
        for message in split_messages(text, final):
            if message.recipient is not None:
                arguments = message.body.strip() if message.closed else message.body.lstrip().rstrip()
                calls.append(ParsedToolCall(message.recipient, arguments))
            elif message.channel in ("final", "commentary"):
                content.append(message.body)
        return ToolParseResult("".join(content), calls)
