"""JSON tool calls (`{"name": ..., "arguments": {...}}`), read while they are being written.

A call is recognised as soon as its `name` is complete; its arguments are then the model's own JSON text, so a
partial call's arguments are a prefix of the final ones and stream as deltas. Where the arguments end is found
by the standard JSON decoder once they are complete; until then every character belongs to them, except a
trailing `}` or whitespace, held back because it may close the call object rather than the arguments.
"""

from __future__ import annotations

import json
import re

from hearth.server.tool_parsers.base import ParsedToolCall, arguments_json

_DECODER = json.JSONDecoder()
_NAME_FIRST = re.compile(
    r'\s*\{\s*"name"\s*:\s*"(?P<name>(?:[^"\\]|\\.)*)"'
    r'(?P<args>\s*,\s*"(?:arguments|parameters)"\s*:\s*)?'
)
_HELD = " \t\r\n}"


def json_call(body: str, closed: bool) -> ParsedToolCall | None:
    """The call in `body` (one JSON object, possibly unfinished); None when it is not (yet) a call."""
    match = _NAME_FIRST.match(body)
    if match is None:
        if not closed:
            return None
        return _whole_call(body)
    name = json.loads(f'"{match["name"]}"')
    if match["args"] is None:
        if closed:
            whole = _whole_call(body)
            return whole if whole is not None and whole.name == name else ParsedToolCall(name, "{}")
        return ParsedToolCall(name, "")
    start = match.end()
    if start >= len(body) or body[start] not in "{[":
        # No object (yet): nothing streams; a closed call's value is read whole, or kept as the model wrote it.
        if not closed:
            return ParsedToolCall(name, "")
        whole = _whole_call(body)
        if whole is not None and whole.name == name:
            return whole
    try:
        _, end = _DECODER.raw_decode(body, start)
        return ParsedToolCall(name, body[start:end])
    except json.JSONDecodeError:
        pass
    rest = body[start:]
    if not closed:
        return ParsedToolCall(name, rest.rstrip(_HELD))
    # Broken JSON: the model's text minus the brace that closed the call object.
    rest = rest.rstrip()
    if rest.endswith("}") and rest.count("}") > rest.count("{"):
        rest = rest[:-1].rstrip()
    return ParsedToolCall(name, rest)


def _whole_call(body: str) -> ParsedToolCall | None:
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    return ParsedToolCall(value["name"], arguments_json(value.get("arguments", value.get("parameters", {}))))


def json_call_sequence(text: str, separators: str, final: bool) -> tuple[list[ParsedToolCall], int, bool]:
    """Calls written back to back as JSON objects (separated by any of `separators` and whitespace), from the
    start of `text`. Returns the calls, where reading stopped, and whether the rest is undecided (an object
    still being written) rather than something that is not a call."""
    calls: list[ParsedToolCall] = []
    pos = 0
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] in separators):
            pos += 1
        if pos >= len(text):
            return calls, pos, False
        if text[pos] != "{":
            return calls, pos, False
        try:
            _, end = _DECODER.raw_decode(text, pos)
        except json.JSONDecodeError:
            call = json_call(text[pos:], closed=final)
            if call is None:
                return calls, pos, not final
            calls.append(call)
            return calls, len(text), False
        call = json_call(text[pos:end], closed=True)
        if call is None:
            return calls, pos, False
        calls.append(call)
        pos = end
