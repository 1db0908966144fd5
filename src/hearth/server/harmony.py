"""OpenAI's Harmony format (gpt-oss), split into messages while it streams.

An answer is a run of messages: `<|channel|>CHANNEL [to=functions.NAME] [<|constrain|>json]<|message|>BODY`
ended by `<|end|>`, `<|call|>` or `<|return|>`, the next starting with `<|start|>assistant`. The `analysis`
channel is reasoning, `final` is the answer, and a message with a recipient is a tool call whose body is the
arguments. The tool parser and the reasoning parser both read the answer through `split_messages`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from hearth.server.text_markers import hold_back

START = "<|start|>"
MESSAGE = "<|message|>"
CHANNEL = "<|channel|>"
TERMINATORS = ("<|end|>", "<|call|>", "<|return|>")
MARKERS = (START, MESSAGE, CHANNEL, *TERMINATORS)
_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT = re.compile(r"\bto=(?:functions\.)?([^\s<]+)")


@dataclass
class HarmonyMessage:
    channel: str
    recipient: str | None
    body: str
    closed: bool
    raw: str  # the message as written, markers included


def is_harmony(text: str, final: bool) -> bool | None:
    """Whether the answer is in Harmony format; None while that cannot be told yet."""
    stripped = text.lstrip()
    if stripped.startswith((CHANNEL, START)):
        return True
    if not final and (CHANNEL.startswith(stripped) or START.startswith(stripped)):
        return None
    return False


def split_messages(text: str, final: bool) -> list[HarmonyMessage]:
    """The messages of `text` whose header is complete; the last one's body may be partial."""
    messages = []
    for chunk in text.split(START):
        if not final:
            chunk = hold_back(chunk, MARKERS)
        header, sep, rest = chunk.partition(MESSAGE)
        if not sep:
            continue  # a header still being written, or the empty text before the first <|start|>
        ends = [rest.find(marker) for marker in TERMINATORS if marker in rest]
        closed = bool(ends) or final
        body = rest[: min(ends)] if ends else rest
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        messages.append(
            HarmonyMessage(
                channel.group(1) if channel else "",
                recipient.group(1) if recipient else None,
                body,
                closed,
                START + chunk if messages or text.lstrip().startswith(START) else chunk,
            )
        )
    return messages
