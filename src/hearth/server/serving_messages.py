"""`POST /v1/messages` (Anthropic's Messages API) and `POST /v1/messages/count_tokens`.

A Messages request becomes a chat request and runs through the chat path; its output is read through the
reasoning and tool-call parsers into `thinking`, `text` and `tool_use` blocks. Streams follow Anthropic's
events: `message_start`, then per block `content_block_start`, `content_block_delta`s (`thinking_delta`,
`text_delta`, `input_json_delta`), `content_block_stop`, then `message_delta` (stop reason, usage) and
`message_stop`. Errors have Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import partial_json_parser
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from hearth.server.disconnect import respond
from hearth.server.errors import APIError, from_validation_error
from hearth.server.generation import engine_error, engine_failure
from hearth.server.messages_protocol import (
    CountTokensRequest,
    MessagesRequest,
    chat_messages,
    chat_tool_choice,
    chat_tools,
    template_kwargs,
)
from hearth.server.output_parsing import OutputDelta, OutputParser
from hearth.server.protocol import ChatCompletionRequest
from hearth.server.serving_chat import ChatRun, prepare_chat, render_chat
from hearth.server.sessions import session_key
from hearth.server.sse import dumps
from hearth.server.state import ServerState

# Anthropic's error types by HTTP status.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_error_body(status_code: int, message: str) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(status_code, "api_error" if status_code >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def anthropic_error(exc: APIError) -> JSONResponse:
    message = (
        f"{exc.param}: {exc.message}" if exc.param and not exc.message.startswith(exc.param) else exc.message
    )
    return JSONResponse(
        anthropic_error_body(exc.status_code, message), status_code=exc.status_code, headers=exc.headers
    )


def _sse(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: {dumps(event)}\n\n".encode()


def _chat_request(request: CountTokensRequest, stream: bool = False) -> ChatCompletionRequest:
    body: dict[str, Any] = {"model": request.model, "messages": chat_messages(request), "stream": stream}
    max_tokens = request.max_tokens if isinstance(request, MessagesRequest) else None
    optional: dict[str, Any] = {
        "tools": chat_tools(request.tools),
        "tool_choice": chat_tool_choice(request.tool_choice),
        "chat_template_kwargs": template_kwargs(request.thinking, max_tokens),
    }
    if request.tool_choice is not None and request.tool_choice.disable_parallel_tool_use:
        optional["parallel_tool_calls"] = False
    if isinstance(request, MessagesRequest):
        optional.update(
            {
                "max_completion_tokens": request.max_tokens,
                "temperature": request.temperature,
                "top_p": request.top_p,
                "top_k": request.top_k,
                "stop": request.stop_sequences,
                "user": request.metadata.user_id if request.metadata else None,
                "cache_salt": request.cache_salt,
                "kv_transfer": request.kv_transfer.model_dump() if request.kv_transfer else None,
            }
        )
    body.update({key: value for key, value in optional.items() if value is not None})
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from exc


async def count_tokens(state: ServerState, request: CountTokensRequest) -> dict[str, Any]:
    prompt_ids, _, _, _ = await render_chat(state, _chat_request(request))
    return {"input_tokens": len(prompt_ids)}


async def create_message(state: ServerState, request: MessagesRequest, raw: Request) -> Response:
    user_id = request.metadata.user_id if request.metadata else None
    session = session_key(raw.headers, {"metadata": {"user_id": user_id}}) or _cache_control_session(request)
    run = await prepare_chat(state, _chat_request(request, request.stream), raw, "msg", session)
    message = _Message(state, request, run)
    return await respond(raw, request.stream, message.stream, message.complete, run.generation.close)


class _Message:
    """One Messages request in flight: its content blocks as they are parsed, and its answer."""

    def __init__(self, state: ServerState, request: MessagesRequest, run: ChatRun) -> None:
        self.state = state
        self.request = request
        self.run = run
        self.id = f"msg_{uuid.uuid4().hex}"
        self.parser: OutputParser = run.output_parser(state)
        self.blocks: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._call_blocks: dict[int, int] = {}  # call index -> block index
        self._arguments: dict[int, str] = {}  # block index -> arguments text so far

    def usage(self) -> dict[str, Any]:
        usage = self.run.generation.usage()
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        # Anthropic counts cache reads apart from input_tokens. Hearth caches every prompt on its own and
        # charges nothing to write it, so nothing is reported as cache creation.
        return {
            "input_tokens": usage["prompt_tokens"] - cached,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
            "output_tokens": usage["completion_tokens"],
            "cached_tokens_by_source": usage["prompt_tokens_details"]["cached_tokens_by_source"],
        }

    def stop(self, finish_reason: str | None, stop_reason: str | int | None) -> tuple[str, str | None]:
        if finish_reason == "length":
            return "max_tokens", None
        if any(block["type"] == "tool_use" for block in self.blocks):
            return "tool_use", None
        if isinstance(stop_reason, str) and stop_reason in (self.request.stop_sequences or []):
            return "stop_sequence", stop_reason
        return "end_turn", None

    # ---- blocks ------------------------------------------------------------------------------------

    def _start(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._stop_open()
        self._open = block
        self.blocks.append(block)
        shown = dict(block)
        if block["type"] == "tool_use":
            shown["input"] = {}
        events.append({"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": shown})
        return events

    def _stop_open(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        index = self.blocks.index(self._open)
        block, self._open = self._open, None
        events = []
        if block["type"] == "thinking":
            events.append(
                {
                    "type": "content_block_delta",
                    "index": index,
                    "delta": {"type": "signature_delta", "signature": ""},
                }
            )
        if block["type"] == "tool_use":
            block["input"] = _input_object(self._arguments.get(index, ""))
        events.append({"type": "content_block_stop", "index": index})
        return events

    def feed(self, delta: OutputDelta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if delta.reasoning:
            if self._open is None or self._open["type"] != "thinking":
                events += self._start({"type": "thinking", "thinking": "", "signature": ""})
            assert self._open is not None
            self._open["thinking"] += delta.reasoning
            events.append(
                {
                    "type": "content_block_delta",
                    "index": len(self.blocks) - 1,
                    "delta": {"type": "thinking_delta", "thinking": delta.reasoning},
                }
            )
        if delta.content:
            if self._open is None or self._open["type"] != "text":
                events += self._start({"type": "text", "text": ""})
            assert self._open is not None
            self._open["text"] += delta.content
            events.append(
                {
                    "type": "content_block_delta",
                    "index": len(self.blocks) - 1,
                    "delta": {"type": "text_delta", "text": delta.content},
                }
            )
        for call in delta.tool_calls:
            if call.name is not None:
                tool_id = (
                    "toolu_" + (call.id or "").removeprefix("call_")
                    if (call.id or "").startswith("call_")
                    else call.id
                )
                events += self._start({"type": "tool_use", "id": tool_id, "name": call.name, "input": {}})
                self._call_blocks[call.index] = len(self.blocks) - 1
            index = self._call_blocks[call.index]
            if call.arguments:
                self._arguments[index] = self._arguments.get(index, "") + call.arguments
                events.append(
                    {
                        "type": "content_block_delta",
                        "index": index,
                        "delta": {"type": "input_json_delta", "partial_json": call.arguments},
                    }
                )
        return events

    def close(self) -> list[dict[str, Any]]:
        events = self._stop_open()
        for index, block in enumerate(self.blocks):
            if block["type"] == "tool_use":
                block["input"] = _input_object(self._arguments.get(index, ""))
        return events

    def _message(self, finish_reason: str | None, stop_reason: str | int | None) -> dict[str, Any]:
        reason, sequence = self.stop(finish_reason, stop_reason)
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.state.config.model_name,
            "content": self.blocks,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": self.usage(),
        }

    # ---- answers -----------------------------------------------------------------------------------

    async def complete(self) -> Response:
        text, finish = "", (None, None)
        try:
            async for _, output in self.run.generation.outputs():
                failure = engine_failure(output)
                if failure is not None:
                    raise failure
                text += output.new_text
                if output.finished:
                    finish = (output.finish_reason, output.stop_reason)
        except APIError as exc:
            return anthropic_error(exc)
        except Exception as exc:
            return anthropic_error(engine_error(exc))
        self.feed(self.parser.feed(text, final=True))
        self.close()
        body = self._message(*finish)
        kv_transfer = self.run.generation.kv_transfer_answer()
        if kv_transfer is not None:
            body["kv_transfer"] = kv_transfer
        return JSONResponse(body)

    async def stream(self) -> AsyncIterator[bytes]:
        started = False
        try:
            finish: tuple[str | None, str | int | None] = (None, None)
            async for _, output in self.run.generation.outputs():
                failure = engine_failure(output)
                if failure is not None:
                    raise failure
                if not started:  # after the first output, when the prompt's cache hits are known
                    started = True
                    head = {**self._message(None, None), "content": [], "stop_reason": None}
                    head["usage"] = {**self.usage(), "output_tokens": 0}
                    yield _sse({"type": "message_start", "message": head})
                for event in self.feed(self.parser.feed(output.new_text, final=output.finished)):
                    yield _sse(event)
                if output.finished:
                    finish = (output.finish_reason, output.stop_reason)
            for event in self.close():
                yield _sse(event)
            reason, sequence = self.stop(*finish)
            yield _sse(
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": self.usage(),
                }
            )
            yield _sse({"type": "message_stop"})
        except Exception as exc:  # after the 200 went out, an error can only be reported in the stream
            error = exc if isinstance(exc, APIError) else engine_error(exc)
            yield _sse(anthropic_error_body(error.status_code, error.message))
        finally:
            self.run.generation.close()


def _cache_control_session(request: MessagesRequest) -> str | None:
    """`cache_control` breakpoints as a retention hint: a request that marks its prefix for caching, and names
    no session otherwise, is retained as a session named by that prefix (its system prompt and tools)."""
    blocks: list[Any] = [
        *(request.system if isinstance(request.system, list) else []),
        *(request.tools or []),
    ]
    for message in request.messages:
        if isinstance(message.content, list):
            blocks.extend(message.content)
    marked = any(
        (block.get("cache_control") if isinstance(block, dict) else getattr(block, "cache_control", None))
        for block in blocks
    )
    if not marked:
        return None
    prefix = json.dumps(
        [request.system, [tool.model_dump() for tool in request.tools or []]], sort_keys=True, default=str
    )
    return "cc:" + hashlib.sha256(prefix.encode()).hexdigest()[:24]


def _input_object(arguments: str) -> dict[str, Any]:
    """A tool_use block's `input` (an object, as Anthropic requires) from the call's arguments text. Arguments
    cut short (at max_tokens) are completed by partial-json-parser to the object written so far."""
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        try:
            value = partial_json_parser.loads(arguments)
        except (partial_json_parser.MalformedJSON, ValueError, IndexError):
            return {"_raw_arguments": arguments}  # not JSON at all: shown as written rather than dropped
    return value if isinstance(value, dict) else {"value": value}
