"""Pythonic calls (Llama 3.2/4, ToolACE): the whole answer is a Python list of calls,
`[get_weather(city="Paris"), get_time()]`, with literal keyword arguments. Read with `ast`; a call is streamed
once its closing parenthesis is written (its arguments arrive whole)."""

from __future__ import annotations

import ast
import json
import re

from hearth.server.tool_parsers.base import ParsedToolCall, ToolParser, ToolParseResult

_CALL_START = re.compile(r"\s*\[\s*[A-Za-z_][\w.]*\s*\(")
_PYTHON_TAG = "<|python_tag|>"


def _calls(source: str) -> list[ParsedToolCall] | None:
    """The calls of a list literal of calls, or None when `source` is not one."""
    try:
        tree = ast.parse(source.strip(), mode="eval")
    except SyntaxError:
        return None
    if not isinstance(tree.body, ast.List):
        return None
    calls = []
    for node in tree.body.elts:
        if (
            not isinstance(node, ast.Call)
            or node.args
            or not isinstance(node.func, (ast.Name, ast.Attribute))
        ):
            return None
        try:
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
        except (ValueError, SyntaxError, TypeError):
            return None
        if len(arguments) != len(node.keywords):
            return None
        calls.append(ParsedToolCall(ast.unparse(node.func), json.dumps(arguments, ensure_ascii=False)))
    return calls


def _could_start_calls(text: str) -> bool:
    """Whether `text` is a prefix of something that starts like `[name(`."""
    if _CALL_START.match(text):
        return True
    probe = text + "x("  # complete the opening with a name and a parenthesis where that fits
    return bool(_CALL_START.match(probe)) or bool(_CALL_START.match(text + "("))


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def parse(self, text: str, final: bool) -> ToolParseResult:
        body = text.lstrip()
        if body.startswith(_PYTHON_TAG):
            body = body[len(_PYTHON_TAG) :]
        if not _could_start_calls(body):
            if not final and _PYTHON_TAG.startswith(text.lstrip()):
                return ToolParseResult("")
            return ToolParseResult(text)
        whole = _calls(body)
        if whole is not None:
            return ToolParseResult("", whole)
        # Calls so far: the longest prefix ending in `)` that reads as a list once closed.
        for end in range(len(body) - 1, -1, -1):
            if body[end] == ")":
                partial = _calls(body[: end + 1] + "]")
                if partial is not None:
                    if final:
                        return ToolParseResult(body[end + 1 :].lstrip(",] \n"), partial)
                    return ToolParseResult("", partial)
        return ToolParseResult(text if final else "")
