"""OpenAI-shaped errors: one exception type the handlers raise, one JSON body every client understands."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from pydantic import ValidationError


class APIError(Exception):
    """An error the client should see as `{"error": {"message", "type", "param", "code"}}` with `status_code`."""

    def __init__(
        self,
        message: str,
        status_code: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


def error_body(
    message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(message, 400, "invalid_request_error", param, code)


def from_validation_error(exc: ValidationError) -> APIError:
    """The first pydantic error, named by its dotted field path so the client knows what to fix."""
    first = exc.errors(include_url=False)[0]
    if first["type"] == "json_invalid":
        return bad_request(f"Invalid JSON body: {first['msg']}", code="invalid_json")
    param = ".".join(_field_path(first["loc"])) or None
    value = first.get("input")
    shown = (
        repr(value) if not isinstance(value, (dict, list)) or len(repr(value)) < 200 else type(value).__name__
    )
    message = f"{param}: {first['msg']} (got {shown})" if param else first["msg"]
    return bad_request(message, param=param, code="invalid_value")


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _field_path(loc: tuple[int | str, ...]) -> list[str]:
    # pydantic puts union branch tags ("str", "list[int]", "NamedToolChoice") in the location; clients want fields.
    path = []
    for part in loc:
        text = str(part)
        if isinstance(part, str) and ("[" in text or "-" in text or text in _TYPE_TAGS or text[:1].isupper()):
            continue
        path.append(text)
    return path
