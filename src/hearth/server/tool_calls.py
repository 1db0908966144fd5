"""Tool calls for one choice: the parser, plus what `tool_choice` asks for, over a streaming output.

Calls stream as vLLM streams them: a call's first delta carries its index, id and name (and whatever arguments
are known), the following ones only more argument text. The non-streaming path runs the same extractor on the
whole text in one feed, so streamed and non-streamed answers carry the same content and calls.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from hearth.server.tool_parsers import ParsedToolCall, ToolParser


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass
class ToolCallDelta:
    index: int
    arguments: str  # more argument text
    name: str | None = None  # with `id`, only on a call's first delta
    id: str | None = None


@dataclass
class ExtractedDelta:
    content: str
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ToolCallExtractor:
    """Feed text deltas, get content deltas and call deltas; `calls` holds every call so far, with its id.

    `forced_prefix` is text the server put at the start of the answer (the model continues it), so it is
    parsed but never shown. With `forced_function` (a named `tool_choice`), an answer the parser cannot read
    still becomes one call of that function, with the model's raw text as its arguments.
    """

    def __init__(
        self, parser: ToolParser, forced_prefix: str = "", forced_function: str | None = None
    ) -> None:
        self.parser = parser
        self.forced_function = forced_function
        self._prefix = forced_prefix
        self._text = forced_prefix
        self._sent_content_len = 0
        self._sent_arguments_len: list[int] = []
        self.calls: list[ParsedToolCall] = []
        self.finished = False

    def feed(self, delta: str, final: bool = False) -> ExtractedDelta:
        if self.finished:
            raise RuntimeError("feed() after the final delta")
        self._text += delta
        result = self.parser.parse(self._text, final)
        calls = result.tool_calls
        # Whitespace is held back until something follows it: the newlines models put between calls
        # would otherwise become content.
        content = result.content.rstrip() if not final or calls else result.content
        if final:
            self.finished = True
            if self.forced_function is not None and not calls:
                calls = [ParsedToolCall(self.forced_function, self._raw_forced_arguments())]
                content = content[: self._sent_content_len]
        new_content = content[self._sent_content_len :]
        self._sent_content_len = max(self._sent_content_len, len(content))
        deltas = []
        for index, call in enumerate(calls):
            if index == len(self.calls):
                self.calls.append(ParsedToolCall(call.name, call.arguments, call.id or new_call_id()))
                self._sent_arguments_len.append(len(call.arguments))
                deltas.append(ToolCallDelta(index, call.arguments, call.name, self.calls[index].id))
                continue
            sent = self._sent_arguments_len[index]
            if len(call.arguments) > sent:
                deltas.append(ToolCallDelta(index, call.arguments[sent:]))
                self._sent_arguments_len[index] = len(call.arguments)
                self.calls[index].arguments = call.arguments
        return ExtractedDelta(new_content, deltas)

    def _raw_forced_arguments(self) -> str:
        # The model wrote the arguments after the forced prefix; drop the closing brace/tag it added.
        raw = self._text[len(self._prefix) :].strip()
        end_stop = self.parser.call_end_stop()
        if end_stop and raw.endswith(end_stop):
            raw = raw[: -len(end_stop)].rstrip()
        if raw.endswith("}") and raw.count("}") > raw.count("{"):
            raw = raw[:-1].rstrip()
        return raw or "{}"


def extract_all(extractor: ToolCallExtractor, text: str) -> tuple[str | None, list[ParsedToolCall]]:
    """The non-streaming answer: content (None when empty alongside calls) and the calls, with their ids."""
    delta = extractor.feed(text, final=True)
    content: str | None = delta.content
    if extractor.calls and not (content or "").strip():
        content = None
    return content, extractor.calls
