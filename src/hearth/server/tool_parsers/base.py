"""Tool-call parsers: turn a model's raw text into OpenAI `tool_calls` plus the content outside them."""

from __future__ import annotations

import copy
import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from hearth.server.text_markers import hold_back, partial_suffix_len  # noqa: F401  (used by the parsers)


@dataclass
class ParsedToolCall:
    name: str
    # A JSON string, as OpenAI returns it. While the call is still being written, a prefix of the final string.
    arguments: str
    id: str | None = None  # formats that number their calls (Kimi K2) carry their own id


@dataclass
class ToolParseResult:
    content: str
    tool_calls: list[ParsedToolCall] = field(default_factory=list)


def arguments_json(arguments: Any) -> str:
    if isinstance(arguments, str):
        return arguments
    return json.dumps(arguments, ensure_ascii=False)


class ToolParser(ABC):
    """Parses one model output into content and tool calls.

    Contract: `parse(text, final=False)` is called on growing prefixes of the output while it streams and must
    be monotone: for a longer prefix, `content` extends the earlier `content`, `tool_calls` extends the earlier
    list, and each call keeps its name and id while its `arguments` extends the earlier arguments (so they can
    be streamed as deltas). Undecided text (a half-written tag) is left out until it is decided.
    `parse(text, final=True)` decides everything left, under the same rule. The streaming path and the
    non-streaming path both use `parse`, so they return the same calls however the text was split.
    """

    name: ClassVar[str]
    # True when the format's markers are special tokens, which must then survive detokenization.
    needs_special_tokens: ClassVar[bool] = False

    @abstractmethod
    def parse(self, text: str, final: bool) -> ToolParseResult: ...

    def adapt_to_template(self, template_source: str) -> None:  # noqa: B027 (an optional hook)
        """Learn format details (spacing) from the checkpoint's chat template; called once at startup."""

    def for_request(self, tools: list[dict[str, Any]] | None) -> ToolParser:
        """This parser for one request's tools (formats that write argument values untyped use their schemas)."""
        return self

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
    # Markers inside a call body: a half-written one is held back like a half-written end tag.
    inner_markers: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def parse_body(self, body: str, closed: bool) -> ParsedToolCall | None:
        """The call inside one pair of tags. `closed` is False while the body is still being written: then the
        call may be partial (arguments a prefix), or None when it is not recognisable yet. Once a prefix of a
        body gives a call, every longer prefix must give the same call (same name, extended arguments). A
        closed body that is no call returns None and stays content."""

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
                content.append(tail if final else hold_back(tail, (self.start_tag, *self.ignored_markers)))
                break
            content.append(text[pos:start])
            body_start = start + len(self.start_tag)
            end = text.find(self.end_tag, body_start)
            if end == -1:
                # An unterminated last call: partial while streaming; at the end (stopped at EOS or at the
                # end tag) it is whatever it is.
                body = text[body_start:]
                if not final:
                    body = hold_back(body, (self.end_tag, *self.ignored_markers, *self.inner_markers))
                call = self.parse_body(body, closed=final)
                if call is not None:
                    calls.append(call)
                elif final:
                    content.append(text[start:])
                break
            call = self.parse_body(text[body_start:end], closed=True)
            if call is not None:
                calls.append(call)
            else:
                content.append(text[start : end + len(self.end_tag)])
            pos = end + len(self.end_tag)
        return ToolParseResult("".join(content), calls)


class TypedArgumentsMixin:
    """For formats that write each argument's value as bare text (Qwen3-Coder XML, GLM-4.5): the request's tool
    schemas say which values are strings and which are JSON."""

    _param_types: dict[str, dict[str, str]]

    def for_request(self, tools: list[dict[str, Any]] | None) -> Any:
        clone = copy.copy(self)
        clone._param_types = {}
        for tool in tools or []:
            function = tool.get("function", tool)
            properties = (function.get("parameters") or {}).get("properties") or {}
            clone._param_types[function.get("name", "")] = {
                key: spec.get("type", "") if isinstance(spec, dict) else ""
                for key, spec in properties.items()
            }
        return clone

    def typed_value(self, function: str, key: str, raw: str) -> Any:
        kind = getattr(self, "_param_types", {}).get(function, {}).get(key)
        if kind == "string":
            return raw
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw


def arguments_object(pairs: list[tuple[str, Any]], done: bool) -> str:
    """Arguments written one key at a time, as a JSON object whose text only grows: `{"a": 1, "b": 2` then `}`."""
    body = ", ".join(
        f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"
        for key, value in pairs
    )
    return "{" + body + ("}" if done else "")
