"""DeepSeek V3 / R1: `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>`
inside `<｜tool▁calls▁begin｜>` ... `<｜tool▁calls▁end｜>`; V3.1 drops the fence:
`<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`. The markers are special tokens."""

from __future__ import annotations

from hearth.server.tool_parsers.base import ParsedToolCall, TaggedToolParser, hold_back

_SEP = "<｜tool▁sep｜>"
_FENCE_OPEN = "```json"
_FENCE_CLOSE = "```"


class DeepSeekV3ToolParser(TaggedToolParser):
    name = "deepseek_v3"
    needs_special_tokens = True
    start_tag = "<｜tool▁call▁begin｜>"
    end_tag = "<｜tool▁call▁end｜>"
    ignored_markers = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
    inner_markers = (_SEP,)

    def parse_body(self, body: str, closed: bool) -> ParsedToolCall | None:
        head, sep, rest = body.partition(_SEP)
        if not sep:
            return None
        if head.strip() != "function":  # V3.1: the name is before the separator
            return ParsedToolCall(head.strip(), rest.strip() if closed else rest.lstrip().rstrip())
        name, newline, fenced = rest.partition("\n")
        if not newline and not closed:
            return None  # the name may not be finished
        fenced = fenced.lstrip()
        if fenced.startswith(_FENCE_OPEN):
            fenced = fenced[len(_FENCE_OPEN) :]
        elif not closed and _FENCE_OPEN.startswith(fenced):
            return ParsedToolCall(name.strip(), "")
        arguments, fence_closed, _ = fenced.partition(_FENCE_CLOSE)
        if closed or fence_closed:
            return ParsedToolCall(name.strip(), arguments.strip())
        return ParsedToolCall(name.strip(), hold_back(arguments, (_FENCE_CLOSE,)).strip())
