"""The `POST /v1/responses` request body, validated strictly, and its conversion to a chat request."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from hearth.server.errors import bad_request
from hearth.server.protocol import MAX_INT, FunctionName, KVTransferField

_CONFIG = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


class _Model(BaseModel):
    model_config = _CONFIG


class FunctionToolChoice(_Model):
    type: Literal["function"]
    name: FunctionName


class TextFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(max_length=64)] | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Model):
    format: TextFormat | None = None


class ReasoningConfig(_Model):
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


# `include` values a Hearth answer can honour: encrypted reasoning is never produced, so asking for it is
# harmless (the reasoning item carries the text instead).
SUPPORTED_INCLUDES = {"reasoning.encrypted_content"}


class ResponsesRequest(_Model):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    background: bool = False
    include: list[str] | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=MAX_INT)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    prompt_cache_key: str | None = None  # a routing hint (the router's session affinity); nothing to do here
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    kv_transfer: KVTransferField | None = None


def check_supported(request: ResponsesRequest) -> None:
    """Fields whose value would change the answer in ways Hearth cannot: refused, never ignored."""
    if request.background:
        raise bad_request("background responses are not supported; send background: false", "background")
    for value in request.include or []:
        if value not in SUPPORTED_INCLUDES:
            raise bad_request(f"include {value!r} is not supported", "include")


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools (flat) as chat tools (nested under `function`)."""
    if tools is None:
        return None
    converted = []
    for index, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise bad_request(
                f"tools[{index}]: only function tools are supported, got type {tool.get('type')!r}",
                f"tools[{index}].type",
            )
        function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
        if "name" not in function:
            raise bad_request(f"tools[{index}]: a function tool needs a name", f"tools[{index}].name")
        converted.append({"type": "function", "function": function})
    return converted


def _text_of(content: Any, path: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{path}: content must be a string or a list of parts", path)
    texts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise bad_request(
                f"{path}[{k}]: only text parts (input_text, output_text) are supported, got {kind!r}",
                f"{path}[{k}].type",
            )
        texts.append(part["text"])
    return "".join(texts)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses input items as chat messages: messages, function calls (joined into the assistant message
    that made them), function call outputs (tool messages), reasoning (the next assistant turn's
    reasoning_content)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    pending_reasoning: str | None = None
    for index, item in enumerate(items):
        path = f"input[{index}]"
        if not isinstance(item, dict):
            raise bad_request(f"{path}: an input item must be an object", path)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(
                    f"{path}.role: must be user, assistant, system or developer", f"{path}.role"
                )
            message: dict[str, Any] = {
                "role": role,
                "content": _text_of(item.get("content"), f"{path}.content"),
            }
            if role == "assistant" and pending_reasoning is not None:
                message["reasoning_content"] = pending_reasoning
                pending_reasoning = None
            messages.append(message)
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise bad_request(f"{path}.{key}: a function_call needs a string {key}", f"{path}.{key}")
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and pending_reasoning is None:
                last.setdefault("tool_calls", []).append(call)  # the calls of the turn that wrote this text
                continue
            message = {"role": "assistant", "content": None, "tool_calls": [call]}
            if pending_reasoning is not None:
                message["reasoning_content"] = pending_reasoning
                pending_reasoning = None
            messages.append(message)
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad_request(
                    f"{path}.call_id: a function_call_output needs a call_id", f"{path}.call_id"
                )
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of(output, f"{path}.output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            pending_reasoning = "".join(p.get("text", "") for p in parts if isinstance(p, dict))
        else:
            raise bad_request(
                f"{path}.type: input items of type {kind!r} are not supported "
                "(message, function_call, function_call_output, reasoning are)",
                f"{path}.type",
            )
    return messages


def response_format(text: TextConfig | None) -> dict[str, Any] | None:
    """`text.format` as the chat `response_format`, which the structured-output engine enforces."""
    if text is None or text.format is None or text.format.type == "text":
        return None
    spec = text.format
    if spec.type == "json_object":
        return {"type": "json_object"}
    if spec.schema_ is None:
        raise bad_request('text.format of type "json_schema" needs a schema', "text.format.schema")
    schema = {"name": spec.name, "schema": spec.schema_, "strict": spec.strict}
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


def chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, FunctionToolChoice):
        return {"type": "function", "function": {"name": choice.name}}
    return choice


def arguments_text(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments)
