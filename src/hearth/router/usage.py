"""Rewriting `usage` in proxied responses: the JSON body and the SSE chunk that carries it.

In PD mode the decode server saw the prompt arrive as transferred KV, so its own cached-token count
describes the wrong cache. The prefill side's number is the one that tells the client what was reused.
Every API names it its own way: chat/completions `usage.prompt_tokens_details.cached_tokens`, Responses
`usage.input_tokens_details.cached_tokens` (in a stream, inside the event's `response`), Messages
`usage.cache_read_input_tokens` with `input_tokens` counting only the rest (in a stream, in
`message_start`'s `message` and in `message_delta`). Hearth's `cached_tokens_by_source` (next to
`cached_tokens`; at the top of Messages usage) takes the prefill side's device/tier/store split and keeps
the decode side's `peer` count (the tokens the transfer brought).
"""

from __future__ import annotations

import json
from typing import Any

DATA_PREFIX = b"data:"


def cached_tokens_of(usage: Any) -> int | None:
    if not isinstance(usage, dict):
        return None
    if isinstance(usage.get("cache_read_input_tokens"), int):
        return usage["cache_read_input_tokens"]
    for name in ("prompt_tokens_details", "input_tokens_details"):
        details = usage.get(name)
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            return details["cached_tokens"]
    return None


def by_source_of(usage: Any) -> dict[str, int] | None:
    """Hearth's `cached_tokens_by_source` of a usage object of any API, or None."""
    if not isinstance(usage, dict):
        return None
    holders = [usage, usage.get("prompt_tokens_details"), usage.get("input_tokens_details")]
    for holder in holders:
        if isinstance(holder, dict) and isinstance(holder.get("cached_tokens_by_source"), dict):
            return holder["cached_tokens_by_source"]
    return None


def _set_by_source(usage: dict[str, Any], prefill_by_source: dict[str, int] | None) -> None:
    own = by_source_of(usage)
    if own is None or prefill_by_source is None:
        return
    for name in ("device", "tier", "store"):
        value = prefill_by_source.get(name)
        own[name] = value if isinstance(value, int) else 0


def find_usage(payload: dict[str, Any]) -> dict[str, Any] | None:
    """The usage object of an answer or stream event, wherever its API puts it."""
    usage = payload.get("usage")
    if isinstance(usage, dict):
        return usage
    for holder in ("response", "message"):
        inner = payload.get(holder)
        if isinstance(inner, dict) and isinstance(inner.get("usage"), dict):
            return inner["usage"]
    return None


def set_cached_tokens(
    payload: dict[str, Any], cached_tokens: int, by_source: dict[str, int] | None = None
) -> bool:
    usage = find_usage(payload)
    if usage is None or not ("prompt_tokens" in usage or "input_tokens" in usage):
        return False  # no prompt counts here (Anthropic's message_delta may carry output_tokens only)
    _set_by_source(usage, by_source)
    if "cache_read_input_tokens" in usage or (
        "input_tokens" in usage and "input_tokens_details" not in usage
    ):
        # Messages: input_tokens excludes cache reads, so the prompt's total stays what it was.
        total = int(usage.get("input_tokens") or 0) + int(usage.get("cache_read_input_tokens") or 0)
        cached = min(cached_tokens, total)
        usage["cache_read_input_tokens"] = cached
        usage["input_tokens"] = total - cached
        return True
    name = "input_tokens_details" if "input_tokens" in usage else "prompt_tokens_details"
    details = usage.get(name)
    if not isinstance(details, dict):
        details = usage[name] = {}
    details["cached_tokens"] = cached_tokens
    return True


def rewrite_json_body(body: bytes, cached_tokens: int, by_source: dict[str, int] | None = None) -> bytes:
    try:
        payload = json.loads(body)
    except ValueError:
        return body
    if isinstance(payload, dict) and set_cached_tokens(payload, cached_tokens, by_source):
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
        found = find_usage(payload) if payload is not None else None
        if found is not None:
            usage = found
    return usage


def event_has_usage(event: bytes) -> bool:
    """True when some event carries a usage object (not `"usage": null`)."""
    return b'"usage":{' in event or b'"usage": {' in event


def rewrite_event(event: bytes, cached_tokens: int, by_source: dict[str, int] | None = None) -> bytes:
    payload = _event_json(event)
    if payload is None or not set_cached_tokens(payload, cached_tokens, by_source):
        return event
    # Other lines (`event: message_delta`) stay as they were.
    lines = [line for line in event.rstrip(b"\n").split(b"\n") if not line.startswith(DATA_PREFIX)]
    lines.append(b"data: " + json.dumps(payload, separators=(",", ":")).encode())
    return b"\n".join(lines) + b"\n\n"


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
