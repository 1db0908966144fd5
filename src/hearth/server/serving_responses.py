"""`POST /v1/responses` (OpenAI's Responses API) and `GET`/`DELETE /v1/responses/{id}`.

A Responses request becomes a chat request (instructions, the stored conversation of `previous_response_id`,
the input items), runs through the chat path (template, tool plan, structured output, engine), and its output
is read through the same reasoning and tool-call parsers into output items: `reasoning`, `message`,
`function_call`. Streams follow OpenAI's event sequence (`response.created`, `response.in_progress`,
`response.output_item.added`, ... deltas ..., `response.output_item.done`, `response.completed`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from hearth.server.disconnect import respond
from hearth.server.errors import APIError, bad_request, from_validation_error
from hearth.server.generation import engine_error, engine_failure
from hearth.server.output_parsing import OutputDelta
from hearth.server.protocol import ChatCompletionRequest
from hearth.server.response_store import tenant_of
from hearth.server.responses_protocol import (
    ResponsesRequest,
    chat_tool_choice,
    chat_tools,
    check_supported,
    input_messages,
    response_format,
)
from hearth.server.serving_chat import ChatRun, prepare_chat
from hearth.server.sessions import session_key
from hearth.server.sse import dumps
from hearth.server.state import ServerState


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _sse(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: {dumps(event)}\n\n".encode()


class OutputItems:
    """Output items built from parsed deltas, one item open at a time, with the stream events that say so."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._calls: dict[int, dict[str, Any]] = {}  # call index -> its function_call item
        self.sequence_number = 0

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return event

    def _start(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._finish_open()
        self._open = item
        self.items.append(item)
        events.append(
            self.event("response.output_item.added", output_index=len(self.items) - 1, item=dict(item))
        )
        if item["type"] == "message":
            events.append(
                self.event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=len(self.items) - 1,
                    content_index=0,
                    part={"type": "output_text", "text": "", "annotations": []},
                )
            )
        return events

    def _finish_open(self) -> list[dict[str, Any]]:
        item = self._open
        if item is None:
            return []
        self._open = None
        index = self.items.index(item)
        events = []
        if item["type"] == "reasoning":
            text = item["content"][0]["text"]
            events.append(
                self.event(
                    "response.reasoning_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=text,
                )
            )
        elif item["type"] == "message":
            part = item["content"][0]
            events.append(
                self.event(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=part["text"],
                    logprobs=[],
                )
            )
            events.append(
                self.event(
                    "response.content_part.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=part,
                )
            )
        else:
            events.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        item["status"] = "completed"
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events

    def feed(self, delta: OutputDelta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if delta.reasoning:
            if self._open is None or self._open["type"] != "reasoning":
                events += self._start(
                    {
                        "id": _new_id("rs"),
                        "type": "reasoning",
                        "status": "in_progress",
                        "summary": [],
                        "content": [{"type": "reasoning_text", "text": ""}],
                    }
                )
            item = self._open
            assert item is not None
            item["content"][0]["text"] += delta.reasoning
            events.append(
                self.event(
                    "response.reasoning_text.delta",
                    item_id=item["id"],
                    output_index=len(self.items) - 1,
                    content_index=0,
                    delta=delta.reasoning,
                )
            )
        if delta.content:
            if self._open is None or self._open["type"] != "message":
                events += self._start(
                    {
                        "id": _new_id("msg"),
                        "type": "message",
                        "status": "in_progress",
                        "role": "assistant",
                        "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}],
                    }
                )
            item = self._open
            assert item is not None
            item["content"][0]["text"] += delta.content
            events.append(
                self.event(
                    "response.output_text.delta",
                    item_id=item["id"],
                    output_index=len(self.items) - 1,
                    content_index=0,
                    delta=delta.content,
                    logprobs=[],
                )
            )
        for call in delta.tool_calls:
            if call.name is not None:
                events += self._start(
                    {
                        "id": _new_id("fc"),
                        "type": "function_call",
                        "status": "in_progress",
                        "call_id": call.id,
                        "name": call.name,
                        "arguments": "",
                    }
                )
                self._calls[call.index] = self.items[-1]
            item = self._calls[call.index]
            if call.arguments:
                item["arguments"] += call.arguments
                events.append(
                    self.event(
                        "response.function_call_arguments.delta",
                        item_id=item["id"],
                        output_index=self.items.index(item),
                        delta=call.arguments,
                    )
                )
        return events

    def close(self) -> list[dict[str, Any]]:
        events = []
        if not self.items:  # an empty answer is still one (empty) message
            events += self._start(
                {
                    "id": _new_id("msg"),
                    "type": "message",
                    "status": "in_progress",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}],
                }
            )
        return events + self._finish_open()

    def assistant_message(self) -> dict[str, Any]:
        """This output as the chat message a follow-up's conversation holds."""
        text = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "message")
        reasoning = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "reasoning")
        calls = [
            {
                "id": i["call_id"],
                "type": "function",
                "function": {"name": i["name"], "arguments": i["arguments"]},
            }
            for i in self.items
            if i["type"] == "function_call"
        ]
        message: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
        if calls:
            message["tool_calls"] = calls
        if reasoning:
            message["reasoning_content"] = reasoning
        return message


class _Turn:
    """One Responses request in flight: what it was asked, and its answer once known."""

    def __init__(
        self,
        state: ServerState,
        request: ResponsesRequest,
        run: ChatRun,
        conversation: list[dict[str, Any]],
        tenant: str,
        response_id: str,
        session: str,
    ) -> None:
        self.state = state
        self.request = request
        self.run = run
        self.conversation = conversation
        self.tenant = tenant
        self.id = response_id
        self.session = session
        self.created_at = int(time.time())
        self.items = OutputItems()
        self.parser = run.output_parser(state)

    def response(
        self, status: str, finish_reason: str | None = None, error: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        request = self.request
        text_format = (
            request.text.format.model_dump(by_alias=True, exclude_none=True)
            if request.text and request.text.format
            else {"type": "text"}
        )
        body: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if finish_reason == "length" else None,
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "metadata": request.metadata or {},
            "model": self.state.config.model_name,
            "output": self.items.items if status != "in_progress" else [],
            "parallel_tool_calls": request.parallel_tool_calls,
            "previous_response_id": request.previous_response_id,
            "reasoning": request.reasoning.model_dump()
            if request.reasoning
            else {"effort": None, "summary": None},
            "store": request.store,
            "temperature": 1.0 if request.temperature is None else request.temperature,
            "text": {"format": text_format},
            "tool_choice": _tool_choice_field(request),
            "tools": request.tools or [],
            "top_p": 1.0 if request.top_p is None else request.top_p,
            "truncation": request.truncation or "disabled",
            "usage": self.usage() if status != "in_progress" else None,
            "user": request.user,
        }
        kv_transfer = self.run.generation.kv_transfer_answer()
        if kv_transfer is not None:
            body["kv_transfer"] = kv_transfer
        return body

    def usage(self) -> dict[str, Any]:
        usage = self.run.generation.usage()
        reasoning = "".join(i["content"][0]["text"] for i in self.items.items if i["type"] == "reasoning")
        reasoning_tokens = (
            len(self.state.require_engine().tokenizer.encode(reasoning, add_special_tokens=False))
            if reasoning
            else 0
        )
        return {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": usage["prompt_tokens_details"],
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, usage["completion_tokens"])},
            "total_tokens": usage["total_tokens"],
        }

    def finish(self, finish_reason: str | None) -> dict[str, Any]:
        response = self.response("incomplete" if finish_reason == "length" else "completed", finish_reason)
        if self.request.store:
            messages = [*self.conversation, self.items.assistant_message()]
            self.state.responses.put(self.tenant, response, messages, self.session)
        return response


def _tenant(raw: Request) -> str:
    # The same key sent either way (OpenAI's bearer token, Anthropic's x-api-key) is the same tenant.
    given = raw.headers.get("authorization") or ""
    return tenant_of(given.removeprefix("Bearer ") or raw.headers.get("x-api-key"))


def _tool_choice_field(request: ResponsesRequest) -> Any:
    choice = request.tool_choice
    if choice is None:
        return "auto"
    return choice if isinstance(choice, str) else choice.model_dump()


async def create_response(state: ServerState, request: ResponsesRequest, raw: Request) -> Response:
    check_supported(request)
    tenant = _tenant(raw)
    history: list[dict[str, Any]] = []
    response_id = _new_id("resp")
    # A conversation chained by previous_response_id is one session, named after its first response.
    session = session_key(raw.headers, {"prompt_cache_key": request.prompt_cache_key}) or f"r:{response_id}"
    if request.previous_response_id is not None:
        stored = state.responses.get(tenant, request.previous_response_id)
        if stored is None:
            raise APIError(
                f"Previous response with id {request.previous_response_id!r} not found.",
                404,
                "invalid_request_error",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        history = stored.messages
        session = stored.session or session
    conversation = [*history, *input_messages(request.input)]
    if not conversation:
        raise bad_request("input is empty: give at least one input item", "input")
    messages = [{"role": "system", "content": request.instructions}] if request.instructions else []
    body: dict[str, Any] = {
        "model": request.model,
        "messages": [*messages, *conversation],
        "stream": request.stream,
        "parallel_tool_calls": request.parallel_tool_calls,
    }
    optional = {
        "tools": chat_tools(request.tools),
        "tool_choice": chat_tool_choice(request.tool_choice),
        "response_format": response_format(request.text),
        "max_completion_tokens": request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "user": request.user,
        "cache_salt": request.cache_salt,
        "kv_transfer": request.kv_transfer.model_dump() if request.kv_transfer else None,
        "chat_template_kwargs": {"reasoning_effort": request.reasoning.effort}
        if request.reasoning and request.reasoning.effort
        else None,
    }
    body.update({key: value for key, value in optional.items() if value is not None})
    try:
        chat_request = ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from exc
    run = await prepare_chat(state, chat_request, raw, "resp", session)
    turn = _Turn(state, request, run, conversation, tenant, response_id, session)
    return await respond(
        raw, request.stream, lambda: _stream(turn), lambda: _complete(turn), run.generation.close
    )


async def _complete(turn: _Turn) -> Response:
    text, finish_reason = "", None
    try:
        async for _, output in turn.run.generation.outputs():
            failure = engine_failure(output)
            if failure is not None:
                raise failure
            text += output.new_text
            if output.finished:
                finish_reason = output.finish_reason
    except APIError:
        raise
    except Exception as exc:
        raise engine_error(exc) from exc
    turn.items.feed(turn.parser.feed(text, final=True))
    turn.items.close()
    return JSONResponse(turn.finish(finish_reason))


async def _stream(turn: _Turn) -> AsyncIterator[bytes]:
    items = turn.items
    try:
        yield _sse(items.event("response.created", response=turn.response("in_progress")))
        yield _sse(items.event("response.in_progress", response=turn.response("in_progress")))
        finish_reason = None
        async for _, output in turn.run.generation.outputs():
            failure = engine_failure(output)
            if failure is not None:
                raise failure
            for event in items.feed(turn.parser.feed(output.new_text, final=output.finished)):
                yield _sse(event)
            if output.finished:
                finish_reason = output.finish_reason
        for event in items.close():
            yield _sse(event)
        response = turn.finish(finish_reason)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        yield _sse(items.event(kind, response=response))
    except Exception as exc:  # after the 200 went out, an error can only be reported in the stream
        error = exc if isinstance(exc, APIError) else engine_error(exc)
        failed = turn.response("failed", error={"code": error.code or error.type, "message": error.message})
        yield _sse(items.event("response.failed", response=failed))
    finally:
        turn.run.generation.close()


def _not_found(response_id: str) -> APIError:
    return APIError(
        f"No response with id {response_id!r} found.",
        404,
        "invalid_request_error",
        param="response_id",
        code="not_found",
    )


def get_response(state: ServerState, response_id: str, raw: Request) -> dict[str, Any]:
    stored = state.responses.get(_tenant(raw), response_id)
    if stored is None:
        raise _not_found(response_id)
    return stored.response


def delete_response(state: ServerState, response_id: str, raw: Request) -> dict[str, Any]:
    if not state.responses.delete(_tenant(raw), response_id):
        raise _not_found(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


def input_items(state: ServerState, response_id: str, raw: Request) -> dict[str, Any]:
    """`GET /v1/responses/{id}/input_items`: the conversation that led to the response, as message items."""
    stored = state.responses.get(_tenant(raw), response_id)
    if stored is None:
        raise _not_found(response_id)
    data = [
        {
            "id": f"msg_{k}",
            "type": "message",
            "role": m["role"],
            "content": [{"type": "input_text", "text": m.get("content") or ""}],
        }
        for k, m in enumerate(stored.messages[:-1])
        if m["role"] in ("user", "system", "developer", "assistant")
    ]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": False,
    }
