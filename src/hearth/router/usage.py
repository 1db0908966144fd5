"""Rewriting `usage` in proxied responses: the JSON body and the SSE chunk that carries it.

In PD mode the decode server saw the prompt arrive as transferred KV, so its own
`prompt_tokens_details.cached_tokens` describes the wrong cache. The prefill side's number is
the one that tells the client what was reused.
"""

from __future__ import annotations

import json
from typing import Any

DATA_PREFIX = b"data:"


def cached_tokens_of(usage: Any) -> int | None:
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        return details["cached_tokens"]
    return None


def set_cached_tokens(payload: dict[str, Any], cached_tokens: int) -> bool:
    usage = payload.get("usage")
    if not isinstance(usage, dict):
        return False
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, dict):
        details = usage["prompt_tokens_details"] = {}
    details["cached_tokens"] = cached_tokens
    return True


def rewrite_json_body(body: bytes, cached_tokens: int) -> bytes:
    try:
        payload = json.loads(body)
    except ValueError:
        return body
    if isinstance(payload, dict) and set_cached_tokens(payload, cached_tokens):
        return json.dumps(payload, separators=(",", ":")).encode()
    return body


def usage_from_body(body: bytes) -> dict[str, Any] | None:
    """The usage of a complete response, JSON or SSE (the last chunk that carries one)."""
    try:
        payload = json.loads(body)
        return payload.get("usage") if isinstance(payload, dict) else None
    except ValueError:
        pass
    usage = None
    for event in body.split(b"\n\n"):
        payload = _event_json(event)
        if payload is not None and isinstance(payload.get("usage"), dict):
            usage = payload["usage"]
    return usage


def event_has_usage(event: bytes) -> bool:
    """True when some event carries a usage object (not `"usage": null`)."""
    return b'"usage":{' in event or b'"usage": {' in event


def rewrite_event(event: bytes, cached_tokens: int) -> bytes:
    payload = _event_json(event)
    if payload is None or not set_cached_tokens(payload, cached_tokens):
        return event
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _event_json(event: bytes) -> dict[str, Any] | None:
    for line in event.splitlines():
        if line.startswith(DATA_PREFIX):
            data = line[len(DATA_PREFIX) :].strip()
            if data == b"[DONE]":
                return None
            try:
                payload = json.loads(data)
            except ValueError:
                return None
            return payload if isinstance(payload, dict) else None
    return None


class SSESplitter:
    """Cuts a byte stream into whole SSE events, holding back only an unfinished tail.

    Chunks without a usage field go through as one piece, so pass-through stays chunk by chunk.
    """

    def __init__(self) -> None:
        self._tail = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        data = self._tail + chunk if self._tail else chunk
        end = data.rfind(b"\n\n")
        if end < 0:
            self._tail = data
            return []
        self._tail = data[end + 2 :]
        complete = data[: end + 2]
        if not event_has_usage(complete):
            return [complete]
        return [event + b"\n\n" for event in complete[:-2].split(b"\n\n")]

    def flush(self) -> bytes:
        tail, self._tail = self._tail, b""
        return tail
