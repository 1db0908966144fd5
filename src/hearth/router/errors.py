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


def anthropic_payload(message: str, status: int) -> dict[str, object]:
    kinds = {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
    }
    kind = kinds.get(status, "api_error" if status < 503 else "overloaded_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response_for(path: str, message: str, status: int, code: str | None = None) -> Response:
    """The router's own errors in the shape of the API the client called (Anthropic's on /v1/messages)."""
    if path.startswith("/v1/messages"):
        return json_response(anthropic_payload(message, status), status)
    return error_response(message, status, code)


def sse_error_event_for(path: str, message: str) -> bytes:
    if path.startswith("/v1/messages"):
        return b"event: error\ndata: " + json.dumps(anthropic_payload(message, 502)).encode() + b"\n\n"
    return sse_error_event(message)
