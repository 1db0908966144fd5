"""Tool-call parsers: turn a model's raw text into OpenAI `tool_calls` plus the content outside them."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # a JSON string, as OpenAI returns it
    id: str | None = None  # formats that number their calls (Kimi K2) carry their own id


@dataclass
class ToolParseResult:
    content: str
    tool_calls: list[ParsedToolCall] = field(default_factory=list)


def arguments_json(arguments: Any) -> str:
    if isinstance(arguments, str):
        return arguments
    return json.dumps(arguments, ensure_ascii=False)


def partial_suffix_len(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers` (to hold back)."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:size]):
                longest = size
                break
    return longest


class ToolParser(ABC):
    """Parses one model output into content and tool calls.

    Contract: `parse(text, final=False)` is called on growing prefixes of the output while it streams and must
    be monotone: for a longer prefix, `content` extends the earlier `content` and `tool_calls` extends the
    earlier list (never edits it). Undecided text (a half-written tag, an unterminated call) is left out until
    it is decided. `parse(text, final=True)` decides everything left, under the same rule. The streaming
    path and the non-streaming path both use `parse`, so they return the same calls.
    """

    name: ClassVar[str]
    # True when the format's markers are special tokens, which must then survive detokenization.
    needs_special_tokens: ClassVar[bool] = False

    @abstractmethod
    def parse(self, text: str, final: bool) -> ToolParseResult: ...

    def adapt_to_template(self, template_source: str) -> None:  # noqa: B027 (an optional hook)
        """Learn format details (spacing) from the checkpoint's chat template; called once at startup."""

    def forced_prefix(self, function_name: str | None) -> str | None:
        """Text that starts a call (of `function_name`, or of any tool when None), used to make the model call
        a tool when `tool_choice` requires one. None when the format has no such prefix."""
        return None

    def call_end_stop(self) -> str | None:
        """A stop string that ends a forced call, so generation stops right after it."""
        return None


class TaggedToolParser(ToolParser):
    """Formats that wrap each call in a start and an end tag; subclasses parse the text between them."""

    start_tag: ClassVar[str]
    end_tag: ClassVar[str]
    # Markers around a group of calls that belong to neither content nor a call.
    ignored_markers: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def parse_body(self, body: str) -> ParsedToolCall | None:
        """The call inside one pair of tags, or None when it is not a valid call (it then stays content)."""

    def parse(self, text: str, final: bool) -> ToolParseResult:
        for marker in self.ignored_markers:
            text = text.replace(marker, "")
        content: list[str] = []
        calls: list[ParsedToolCall] = []
        pos = 0
        while True:
            start = text.find(self.start_tag, pos)
            if start == -1:
                tail = text[pos:]
                if not final:
                    tail = tail[
                        : len(tail) - partial_suffix_len(tail, (self.start_tag, *self.ignored_markers))
                    ]
                content.append(tail)
                break
            content.append(text[pos:start])
            body_start = start + len(self.start_tag)
            end = text.find(self.end_tag, body_start)
            if end == -1:
                if final:  # an unterminated last call (stopped at EOS or at the end tag) still counts
                    call = self.parse_body(text[body_start:])
                    if call is not None:
                        calls.append(call)
                    else:
                        content.append(text[start:])
                break
            call = self.parse_body(text[body_start:end])
            if call is not None:
                calls.append(call)
            else:
                content.append(text[start : end + len(self.end_tag)])
            pos = end + len(self.end_tag)
        return ToolParseResult("".join(content), calls)
