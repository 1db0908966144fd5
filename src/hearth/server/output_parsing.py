"""One choice's output, split as it streams: reasoning first (the reasoning parser), then content and tool
calls (the tool-call extractor) from what the reasoning parser left. Chat completions, Responses and Messages
all read their answers through this, so the three APIs split a model's output the same way."""

from __future__ import annotations

from dataclasses import dataclass, field

from hearth.server.reasoning_parsers import ReasoningExtractor, ReasoningParser
from hearth.server.tool_calls import ToolCallDelta, ToolCallExtractor
from hearth.server.tool_parsers import ParsedToolCall


@dataclass
class OutputDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class OutputParser:
    def __init__(
        self,
        reasoning_parser: ReasoningParser | None,
        in_reasoning: bool,
        tools: ToolCallExtractor | None,
    ) -> None:
        self.reasoning = ReasoningExtractor(reasoning_parser, in_reasoning) if reasoning_parser else None
        self.tools = tools
        self.text = ""  # the content, as far as decided

    def feed(self, delta: str, final: bool = False) -> OutputDelta:
        reasoning = ""
        if self.reasoning is not None:
            reasoning, delta = self.reasoning.feed(delta, final)
        if self.tools is None:
            self.text += delta
            return OutputDelta(reasoning, delta)
        extracted = self.tools.feed(delta, final)
        self.text += extracted.content
        return OutputDelta(reasoning, extracted.content, extracted.tool_calls)

    def finish_all(self, text: str) -> tuple[str | None, str | None, list[ParsedToolCall]]:
        """The non-streaming answer: (reasoning, content, calls); content is None when empty alongside calls,
        reasoning None when there was none."""
        self.feed(text, final=True)
        calls = self.tools.calls if self.tools is not None else []
        content: str | None = self.text
        if calls and not self.text.strip():
            content = None
        reasoning = self.reasoning.reasoning if self.reasoning is not None else None
        return reasoning or None, content, calls
