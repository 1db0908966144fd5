"""Server-sent events framed exactly as OpenAI frames them: `data: <json>\\n\\n`, ending with `data: [DONE]`."""

from __future__ import annotations

import json
from typing import Any

DONE_EVENT = b"data: [DONE]\n\n"


def dumps(payload: Any) -> str:
    # Compact separators: the same bytes OpenAI's servers send, and fewer of them per token.
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + dumps(payload).encode() + b"\n\n"
