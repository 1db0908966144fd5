"""OpenAI-shaped error responses and the SSE error event that ends a broken stream."""

from __future__ import annotations

import json

from hearth.router.front import Response, json_response

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
}


def error_payload(message: str, status: int, code: str | None = None) -> dict[str, object]:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def error_response(message: str, status: int, code: str | None = None) -> Response:
    return json_response(error_payload(message, status, code), status)


def sse_error_event(message: str, code: str = "upstream_error") -> bytes:
    """An event the OpenAI clients raise on (a `data:` object with an `error` key)."""
    return b"data: " + json.dumps(error_payload(message, 502, code)).encode() + b"\n\n"
