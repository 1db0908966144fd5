"""Tool-call validity: does a greedy answer hold well-formed `<tool_call>{"name", "arguments"}</tool_call>`
calls naming offered tools, with arguments that fit the tool's JSON schema (no extra keys)? The same rule as
`scripts/eval_demo_model.py` (transformers), so the numbers compare."""

from __future__ import annotations

import json
import re
from typing import Any

TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def tool_call_problem(text: str, tools: list[dict[str, Any]]) -> str | None:
    """None when valid, else why not."""
    import jsonschema

    bodies = TOOL_CALL_RE.findall(text)
    if not bodies:
        return "no <tool_call>...</tool_call>"
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for body in bodies:
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            return "call is not JSON"
        if not isinstance(call, dict) or set(call) != {"name", "arguments"}:
            return "call needs exactly name and arguments"
        if call["name"] not in schemas:
            return "names a tool that was not offered"
        if not isinstance(call["arguments"], dict):
            return "arguments are not a JSON object"
        try:
            jsonschema.validate(call["arguments"], {**schemas[call["name"]], "additionalProperties": False})
        except jsonschema.ValidationError as err:
            return f"arguments do not fit the schema: {err.message}"
    return None
