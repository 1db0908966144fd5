"""gpt-oss (Harmony): the `analysis` channel is reasoning; the other messages stay, markers and all, for the
`openai` tool parser, which reads the calls and the `final` channel from them."""

from __future__ import annotations

from hearth.server.harmony import is_harmony, split_messages
from hearth.server.reasoning_parsers.base import ReasoningParser, ReasoningResult


class HarmonyReasoningParser(ReasoningParser):
    name = "openai_gptoss"
    needs_special_tokens = True

    def parse(self, text: str, final: bool, in_reasoning: bool) -> ReasoningResult:
        harmony = is_harmony(text, final)
        if harmony is None:
            return ReasoningResult("", "")
        if not harmony:
            return ReasoningResult("", text)
        reasoning: list[str] = []
        rest: list[str] = []
        for message in split_messages(text, final):
            if message.channel == "analysis" and message.recipient is None:
                reasoning.append(message.body if message.closed else message.body.rstrip())
            else:
                rest.append(message.raw)
        return ReasoningResult("".join(reasoning), "".join(rest))
