"""`POST /v1/chat/completions`: render the conversation, run n choices, parse tool calls, answer or stream."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from hearth.engine.structured_output import StructuredOutput, json_schema_lark
from hearth.server.chat_template import (
    ChatTemplateError,
    content_chars,
    normalize_messages,
    reserved_template_kwargs,
)
from hearth.server.disconnect import respond
from hearth.server.errors import APIError, bad_request
from hearth.server.generation import (
    Generation,
    chat_logprobs,
    check_logit_bias,
    engine_error,
    engine_failure,
    logger,
    new_request_id,
    prompt_logprobs_entries,
    resolve_max_tokens,
    sampling_params,
    structured_output,
)
from hearth.server.output_parsing import OutputParser
from hearth.server.pd import engine_kv_transfer
from hearth.server.protocol import ChatCompletionRequest, NamedToolChoice, ToolDefinition
from hearth.server.sessions import session_key
from hearth.server.sse import DONE_EVENT, sse_event
from hearth.server.state import ServerState
from hearth.server.tool_calls import ToolCallDelta, ToolCallExtractor, new_call_id
from hearth.server.tool_parsers import ParsedToolCall, ToolParser


class ToolPlan:
    """What the request's `tools` and `tool_choice` mean for this server's parser."""

    def __init__(self, state: ServerState, request: ChatCompletionRequest) -> None:
        tools = request.tools or []
        choice = request.tool_choice
        if choice is None:
            choice = "auto" if tools else "none"
        names = {tool.function.name for tool in tools}
        self.forced_function: str | None = None
        self.forced_prefix = ""
        self.grammar: StructuredOutput | None = None  # what a forced call's text must be, when known
        self.parser: ToolParser | None = None
        self._tools = [tool.model_dump(exclude_unset=True) for tool in tools]
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                raise bad_request(
                    f"tool_choice names function {choice.function.name!r}, which is not in tools",
                    "tool_choice",
                )
            self.forced_function = choice.function.name
        elif choice == "required" and not tools:
            raise bad_request("tool_choice 'required' needs at least one tool in tools", "tool_choice")
        if choice == "none" or not tools:
            return
        parser = state.tool_parser
        if parser is None:
            if choice == "auto":
                return  # no parser configured: the model's text is returned as is
            raise bad_request(
                "this server was started with --tool-call-parser none; it cannot force tool calls",
                "tool_choice",
            )
        self.parser = parser
        if choice == "auto":
            return
        prefix = parser.forced_prefix(self.forced_function)
        if prefix is None:
            raise bad_request(f"the {parser.name} tool-call format cannot force a tool call", "tool_choice")
        self.forced_prefix = prefix
        self.grammar = _forced_call_grammar(parser, tools, self.forced_function)
        if self.grammar is not None:
            try:
                self.grammar.validate()
            except ValueError as exc:
                raise bad_request(f"a tool's parameters cannot be enforced: {exc}", "tools") from exc

    def extractor(self) -> ToolCallExtractor | None:
        if self.parser is None:
            return None
        return ToolCallExtractor(
            self.parser.for_request(self._tools), self.forced_prefix, self.forced_function
        )


def output_parser(state: ServerState, plan: ToolPlan, prompt_text: str) -> OutputParser:
    """How one choice's text splits into reasoning, content and calls."""
    reasoning = state.reasoning_parser
    # A forced call starts the answer itself: there is no reasoning before it.
    in_reasoning = (
        reasoning is not None and not plan.forced_prefix and reasoning.starts_in_reasoning(prompt_text)
    )
    return OutputParser(None if plan.forced_prefix else reasoning, in_reasoning, plan.extractor())


def needs_special_tokens(state: ServerState, plan: ToolPlan) -> bool:
    return (plan.parser is not None and plan.parser.needs_special_tokens) or (
        state.reasoning_parser is not None and state.reasoning_parser.needs_special_tokens
    )


# A forced prefix that ends here leaves the model at the start of a JSON call's arguments object.
_ARGUMENTS_OPENERS = ('"arguments":', '"parameters":')


def _forced_call_grammar(
    parser: ToolParser, tools: list[ToolDefinition], forced_function: str | None
) -> StructuredOutput | None:
    """The rest of a forced call as a grammar: (the tool's name, for `required`) + arguments that fit its
    parameters + the `}` closing the call. Only for JSON call formats whose forced prefix for a named
    function ends at the arguments (Hermes/Qwen); None otherwise, and the call is then only prompted."""
    opening = parser.forced_prefix(forced_function)
    if opening is None:
        return None
    alternatives = []
    for tool in tools:
        if forced_function is not None and tool.function.name != forced_function:
            continue
        full = parser.forced_prefix(tool.function.name)
        if full is None or not full.startswith(opening) or not full.rstrip().endswith(_ARGUMENTS_OPENERS):
            return None
        schema = {"type": "object", **(tool.function.parameters or {})}
        rest = full[len(opening) :]
        arguments = json_schema_lark(schema, strict=bool(tool.function.strict))
        alternatives.append(f"{json.dumps(rest)} {arguments}" if rest else arguments)
    return StructuredOutput.lark_grammar(f'start: ({" | ".join(alternatives)}) "}}"')


def _tool_call_dicts(calls: list[ParsedToolCall]) -> list[dict[str, Any]]:
    return [
        {
            "id": call.id or new_call_id(),
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
        for call in calls
    ]


def _tool_call_delta_dicts(deltas: list[ToolCallDelta]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for delta in deltas:
        if delta.name is not None:
            out.append(
                {
                    "index": delta.index,
                    "id": delta.id,
                    "type": "function",
                    "function": {"name": delta.name, "arguments": delta.arguments},
                }
            )
        else:
            out.append({"index": delta.index, "function": {"arguments": delta.arguments}})
    return out


def _finish_reason(engine_reason: str | None, has_calls: bool) -> str | None:
    if has_calls and engine_reason == "stop":
        return "tool_calls"
    return engine_reason


@dataclass
class ChatRun:
    """A chat request rendered, tokenized and admitted: what every API front (chat, Responses, Messages)
    streams or collects its answer from."""

    generation: Generation
    plan: ToolPlan
    prompt_text: str

    def output_parser(self, state: ServerState) -> OutputParser:
        return output_parser(state, self.plan, self.prompt_text)


async def create_chat_completion(
    state: ServerState, request: ChatCompletionRequest, raw: Request
) -> Response:
    run = await prepare_chat(state, request, raw, "chatcmpl")
    generation, plan = run.generation, run.plan
    return await respond(
        raw,
        request.stream,
        lambda: _stream(state, request, generation, plan, run.prompt_text),
        lambda: _complete(state, request, generation, plan, run.prompt_text),
        generation.close,
    )


async def prepare_chat(
    state: ServerState,
    request: ChatCompletionRequest,
    raw: Request,
    id_prefix: str,
    session: str | None = None,
) -> ChatRun:
    """Validate, render, tokenize and admit a chat request; the caller must `generation.close()` it.

    `session` names the agent session the request is a turn of (default: from the harness's headers); the
    engine retains its pages until the next turn when `--session-retention-s` is on."""
    prompt_ids, prompt_text, plan, structured = await render_chat(state, request)
    engine = state.require_engine()
    max_tokens = resolve_max_tokens(
        request.max_completion_tokens or request.max_tokens,
        len(prompt_ids),
        engine.max_model_len,
        None,
        "messages",
    )
    keep_specials = needs_special_tokens(state, plan)
    end_stop = plan.parser.call_end_stop() if plan.forced_prefix and plan.parser else None
    params = [
        sampling_params(
            request,
            max_tokens,
            (request.top_logprobs or 0) if request.logprobs else None,
            [end_stop] if end_stop else None,
            False if keep_specials else None,
            i,
            structured,
        )
        for i in range(request.n)
    ]
    session = session or session_key(raw.headers, {})
    if session is not None and request.n == 1:
        params[0].retain_session = session
    request_id = new_request_id(id_prefix)
    affinity = raw.headers.get("x-session-affinity")
    if affinity:
        logger.info("request %s session-affinity=%s prompt_tokens=%d", request_id, affinity, len(prompt_ids))
    generation = Generation(
        state,
        request_id,
        [prompt_ids] * request.n,
        params,
        request.cache_salt,
        kv_transfer=await engine_kv_transfer(state, request, request.n),
    )
    generation.admit()
    return ChatRun(generation, plan, prompt_text)


async def render_chat(
    state: ServerState, request: ChatCompletionRequest
) -> tuple[list[int], str, ToolPlan, StructuredOutput | None]:
    """The request's prompt (token ids and text), its tool plan, and the structure its answer must have."""
    state.check_model(request.model)
    engine = state.require_engine()
    if state.chat_template is None:
        raise bad_request(state.chat_template_error or "this model has no chat template", "messages")
    if request.top_logprobs and not request.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    check_logit_bias(request, engine.vocab_size)
    plan = ToolPlan(state, request)
    structured = structured_output(request)
    if structured is not None and plan.forced_prefix:
        raise bad_request(
            "response_format json_object/json_schema cannot be combined with a forced tool_choice "
            "('required' or a named function); drop one of them",
            "response_format",
        )
    template = state.chat_template
    reserved = reserved_template_kwargs(request.chat_template_kwargs)
    if reserved:
        raise bad_request(
            f"chat_template_kwargs may not set {', '.join(reserved)}: the chat template defines them",
            "chat_template_kwargs",
        )
    template_kwargs = request.chat_template_kwargs
    if request.reasoning_effort is not None:
        # As vLLM: the template decides what an effort means; one that never reads it cannot honour it.
        if "reasoning_effort" not in template.source:
            raise bad_request(
                "reasoning_effort: this model's chat template takes no reasoning effort", "reasoning_effort"
            )
        template_kwargs = {**(template_kwargs or {}), "reasoning_effort": request.reasoning_effort}
    prompts = state.require_prompts()
    num_chars = content_chars(request.messages)
    prompts.check_fits(num_chars, "messages")  # before anything is rendered or tokenized
    rendered: list[str] = []

    def render_and_encode() -> list[int]:
        tools = [tool.model_dump(exclude_unset=True) for tool in request.tools] if request.tools else None
        try:
            messages = normalize_messages([m.model_dump(exclude_unset=True) for m in request.messages])
            prompt_text = template.render(
                prompts.escape_specials(messages),
                tools=prompts.escape_specials(tools),
                add_generation_prompt=request.add_generation_prompt and not request.continue_final_message,
                continue_final_message=request.continue_final_message,
                template_kwargs=template_kwargs,
            )
        except ChatTemplateError as exc:
            raise bad_request(str(exc), "messages") from exc
        prompts.check_fits(len(prompt_text), "messages")
        rendered.append(prompt_text)
        # The forced prefix is the server's own text: its special tokens (<tool_call>) are real ones.
        return prompts.encode_chat(prompt_text + plan.forced_prefix)

    prompt_ids = await prompts.run(num_chars, render_and_encode)
    return prompt_ids, rendered[0], plan, structured or plan.grammar


async def _complete(
    state: ServerState,
    request: ChatCompletionRequest,
    generation: Generation,
    plan: ToolPlan,
    prompt_text: str,
) -> Response:
    n = request.n
    texts = [""] * n
    logprobs: list[list[Any]] = [[] for _ in range(n)]
    finish: list[tuple[str | None, str | int | None]] = [(None, None)] * n
    prompt_entries = None
    try:
        async for index, output in generation.outputs():
            failure = engine_failure(output)
            if failure is not None:
                raise failure
            if output.prompt_logprobs is not None and prompt_entries is None:
                prompt_entries = prompt_logprobs_entries(
                    state, generation.prompts[index], output.prompt_logprobs
                )
            texts[index] += output.new_text
            if output.new_logprobs:
                logprobs[index].extend(output.new_logprobs)
            if output.finished:
                finish[index] = (output.finish_reason, output.stop_reason)
    except APIError:
        raise
    except Exception as exc:
        raise engine_error(exc) from exc
    choices = []
    for index in range(n):
        message: dict[str, Any] = {"role": "assistant", "content": texts[index]}
        calls: list[ParsedToolCall] = []
        if plan.parser is not None or state.reasoning_parser is not None:
            reasoning, content, calls = output_parser(state, plan, prompt_text).finish_all(texts[index])
            if not request.parallel_tool_calls:
                calls = calls[:1]  # parallel_tool_calls=false: at most one call
            message["content"] = content
            if state.reasoning_parser is not None:
                message["reasoning_content"] = reasoning
            if calls:
                message["tool_calls"] = _tool_call_dicts(calls)
        reason, stop_reason = finish[index]
        choices.append(
            {
                "index": index,
                "message": message,
                "logprobs": {"content": chat_logprobs(state, logprobs[index], request.top_logprobs or 0)}
                if request.logprobs
                else None,
                "finish_reason": _finish_reason(reason, bool(calls)),
                "stop_reason": stop_reason,
            }
        )
    body = {
        "id": generation.request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": state.config.model_name,
        "choices": choices,
        "usage": generation.usage(),
    }
    if request.prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_entries
    kv_transfer = generation.kv_transfer_answer()
    if kv_transfer is not None:
        body["kv_transfer"] = kv_transfer
    return JSONResponse(body)


async def _stream(
    state: ServerState,
    request: ChatCompletionRequest,
    generation: Generation,
    plan: ToolPlan,
    prompt_text: str,
) -> AsyncIterator[bytes]:
    created = int(time.time())
    include_usage, continuous_usage = request.usage_in_stream
    base = {
        "id": generation.request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": state.config.model_name,
    }

    def chunk(
        index: int,
        delta: dict[str, Any],
        finish_reason: str | None = None,
        logprobs: Any = None,
        stop_reason: str | int | None = None,
    ) -> bytes:
        choice: dict[str, Any] = {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        payload = {**base, "choices": [choice]}
        if include_usage:
            payload["usage"] = generation.usage() if continuous_usage else None
        return sse_event(payload)

    parsing = plan.parser is not None or state.reasoning_parser is not None
    parsers = [output_parser(state, plan, prompt_text) if parsing else None for _ in range(request.n)]
    num_calls = [0] * request.n
    try:
        for index in range(request.n):
            yield chunk(index, {"role": "assistant", "content": ""})
        async for index, output in generation.outputs():
            failure = engine_failure(output)
            if failure is not None:
                yield sse_event(failure.body())
                break
            logprobs = (
                {"content": chat_logprobs(state, output.new_logprobs, request.top_logprobs or 0)}
                if request.logprobs and output.new_logprobs
                else None
            )
            parser = parsers[index]
            if parser is None:
                content, calls, reasoning = output.new_text, [], ""
            else:
                parsed = parser.feed(output.new_text, final=output.finished)
                content, calls, reasoning = parsed.content, parsed.tool_calls, parsed.reasoning
                if not request.parallel_tool_calls:  # at most one call: only call 0's deltas
                    calls = [call for call in calls if call.index == 0]
            if output.prompt_logprobs is not None and request.prompt_logprobs is not None and index == 0:
                payload = {
                    **base,
                    "choices": [],
                    "prompt_logprobs": prompt_logprobs_entries(
                        state, generation.prompts[index], output.prompt_logprobs
                    ),
                }
                yield sse_event(payload)
            if reasoning:
                yield chunk(index, {"reasoning_content": reasoning})
            if content or logprobs is not None:
                yield chunk(index, {"content": content}, logprobs=logprobs)
            if calls:
                yield chunk(index, {"tool_calls": _tool_call_delta_dicts(calls)})
                num_calls[index] += sum(1 for call in calls if call.name is not None)
            if output.finished:
                reason = _finish_reason(output.finish_reason, num_calls[index] > 0)
                yield chunk(index, {}, reason, stop_reason=output.stop_reason)
        else:
            if include_usage:
                yield sse_event({**base, "choices": [], "usage": generation.usage()})
    except APIError as exc:
        yield sse_event(exc.body())
    except Exception as exc:  # an error after the 200 went out can only be reported in the stream
        yield sse_event(engine_error(exc).body())
    finally:
        generation.close()
    yield DONE_EVENT
