"""Which agent session a request belongs to, from what harnesses send.

Harnesses name their session in a header (Hearth's `x-session-affinity`, Claude Code's
`x-claude-code-session-id`, Codex's `session-id`/`session_id`, OpenCode's `x-session-id`) or in the body
(Claude Code's `metadata.user_id`, OpenAI's `prompt_cache_key`). The router keeps a session on one worker;
the server retains a session's KV between its turns (hearth.engine.retention).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

# In order of precedence: the most specific name first.
SESSION_HEADERS = (
    "x-session-affinity",
    "x-claude-code-session-id",
    "session-id",
    "session_id",
    "x-session-id",
)
_LEGACY_CLAUDE_USER_ID = re.compile(r"_session_([0-9a-fA-F-]{8,})$")
MAX_KEY_CHARS = 256


def session_key(headers: Mapping[str, str], body: dict[str, Any]) -> str | None:
    """The request's session, or None. Prefixed by where it came from, so two sources never collide."""
    for name in SESSION_HEADERS:
        value = headers.get(name)
        if value:
            return f"h:{value[:MAX_KEY_CHARS]}"
    metadata = body.get("metadata")
    user_id = metadata.get("user_id") if isinstance(metadata, dict) else None
    if isinstance(user_id, str) and user_id:
        return f"u:{_claude_session(user_id)[:MAX_KEY_CHARS]}"
    cache_key = body.get("prompt_cache_key")
    if isinstance(cache_key, str) and cache_key:
        return f"p:{cache_key[:MAX_KEY_CHARS]}"
    return None


def _claude_session(user_id: str) -> str:
    # Claude Code writes `{"device_id": ..., "session_id": ...}` as a JSON string (older versions
    # `user_<hash>_account_<id>_session_<uuid>`); either way the session id is the stable part.
    try:
        parsed = json.loads(user_id)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict) and isinstance(parsed.get("session_id"), str):
        return parsed["session_id"]
    match = _LEGACY_CLAUDE_USER_ID.search(user_id)
    return match.group(1) if match else user_id
