"""The Anthropic Messages request body (`POST /v1/messages`, `/v1/messages/count_tokens`), validated strictly,
and its conversion to a chat request."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from hearth.server.errors import bad_request
from hearth.server.protocol import MAX_INT, FunctionName, KVTransferField

_CONFIG = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


class _Model(BaseModel):
    model_config = _CONFIG


class AnthropicMessage(_Model):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class AnthropicTool(_Model):
    # Server tools (`bash_20250124`, `web_search_...`) carry a `type`; custom tools have none or "custom".
    type: str | None = None
    name: FunctionName
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None


class AnthropicToolChoice(_Model):
    type: Literal["auto", "any", "tool", "none"]
    name: FunctionName | None = None
    disable_parallel_tool_use: bool = False


class ThinkingConfig(_Model):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[int, Field(ge=1, le=MAX_INT)] | None = None


class Metadata(_Model):
    user_id: str | None = None


class CountTokensRequest(_Model):
    model: str | None = None
    messages: Annotated[list[AnthropicMessage], Field(min_length=1)]
    system: str | list[dict[str, Any]] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None


class MessagesRequest(CountTokensRequest):
    model: str  # type: ignore[assignment]  (required by Anthropic)
    max_tokens: Annotated[int, Field(ge=1, le=MAX_INT)]
    stop_sequences: Annotated[list[str], Field(max_length=16)] | None = None
    stream: bool = False
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0, le=MAX_INT)] | None = None
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    kv_transfer: KVTransferField | None = None


def _system_text(system: str | list[dict[str, Any]]) -> str:
    if isinstance(system, str):
        return system
    texts = []
    for index, block in enumerate(system):
        if block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise bad_request(f"system.{index}: system blocks must be text blocks", f"system.{index}")
        texts.append(block["text"])
    return "\n\n".join(texts)


def _tool_result_text(content: Any, path: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{path}: tool_result content must be a string or a list of text blocks", path)
    texts = []
    for k, block in enumerate(content):
        if (
            not isinstance(block, dict)
            or block.get("type") != "text"
            or not isinstance(block.get("text"), str)
        ):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise bad_request(
                f"{path}.{k}: only text blocks are supported in a tool_result, got {kind!r}", f"{path}.{k}"
            )
        texts.append(block["text"])
    return "\n".join(texts)


def chat_messages(request: CountTokensRequest) -> list[dict[str, Any]]:
    """Anthropic messages as chat messages: tool_use blocks become the assistant's tool_calls, tool_result blocks
    tool messages (before the user's text), thinking blocks the assistant's reasoning_content."""
    messages: list[dict[str, Any]] = []
    if request.system:
        messages.append({"role": "system", "content": _system_text(request.system)})
    for m_index, message in enumerate(request.messages):
        path = f"messages.{m_index}.content"
        if isinstance(message.content, str):
            messages.append({"role": message.role, "content": message.content})
            continue
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        reasoning: list[str] = []
        for b_index, block in enumerate(message.content):
            kind = block.get("type")
            where = f"{path}.{b_index}"
            if kind == "text":
                if not isinstance(block.get("text"), str):
                    raise bad_request(f"{where}.text: a text block needs a text string", f"{where}.text")
                texts.append(block["text"])
            elif kind == "tool_use" and message.role == "assistant":
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                    raise bad_request(f"{where}: a tool_use block needs an id and a name", where)
                if not isinstance(block.get("input", {}), dict):
                    raise bad_request(f"{where}.input: a tool_use input must be an object", f"{where}.input")
                arguments = json.dumps(block.get("input", {}), ensure_ascii=False)
                calls.append(
                    {
                        "id": block["id"],
                        "type": "function",
                        "function": {"name": block["name"], "arguments": arguments},
                    }
                )
            elif kind == "tool_result" and message.role == "user":
                if not isinstance(block.get("tool_use_id"), str):
                    raise bad_request(
                        f"{where}.tool_use_id: a tool_result needs a tool_use_id", f"{where}.tool_use_id"
                    )
                text = _tool_result_text(block.get("content"), f"{where}.content")
                if block.get("is_error"):
                    text = f"Error: {text}"
                messages.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
            elif kind in ("thinking", "redacted_thinking") and message.role == "assistant":
                if kind == "thinking" and isinstance(block.get("thinking"), str):
                    reasoning.append(block["thinking"])
            else:
                raise bad_request(
                    f"{where}.type: {kind!r} blocks are not supported in {message.role} messages "
                    "(text, tool_use, tool_result and thinking are)",
                    f"{where}.type",
                )
        if message.role == "user" and not texts:
            continue  # a message of only tool results
        chat: dict[str, Any] = {
            "role": message.role,
            "content": "".join(texts) if texts or not calls else None,
        }
        if calls:
            chat["tool_calls"] = calls
        if reasoning:
            chat["reasoning_content"] = "".join(reasoning)
        messages.append(chat)
    return messages


def chat_tools(tools: list[AnthropicTool] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    converted = []
    for index, tool in enumerate(tools):
        if tool.type not in (None, "custom"):
            raise bad_request(
                f"tools.{index}: server tools ({tool.type!r}) are not supported; define the tool with an input_schema",
                f"tools.{index}.type",
            )
        if tool.input_schema is None:
            raise bad_request(f"tools.{index}.input_schema: Field required", f"tools.{index}.input_schema")
        function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
        if tool.description is not None:
            function["description"] = tool.description
        converted.append({"type": "function", "function": function})
    return converted


def chat_tool_choice(choice: AnthropicToolChoice | None) -> Any:
    if choice is None:
        return None
    if choice.type == "tool":
        if choice.name is None:
            raise bad_request('tool_choice of type "tool" needs the tool\'s name', "tool_choice.name")
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def template_kwargs(thinking: ThinkingConfig | None, max_tokens: int | None) -> dict[str, Any] | None:
    """`thinking` as the chat template's switch (Qwen3, GLM and DeepSeek templates read `enable_thinking`)."""
    if thinking is None:
        return None
    if thinking.type == "enabled":
        if thinking.budget_tokens is None:
            raise bad_request("thinking.budget_tokens: Field required", "thinking.budget_tokens")
        if max_tokens is not None and thinking.budget_tokens >= max_tokens:
            raise bad_request(
                "max_tokens must be greater than thinking.budget_tokens", "thinking.budget_tokens"
            )
    return {"enable_thinking": thinking.type != "disabled"}
