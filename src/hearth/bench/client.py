"""Streaming OpenAI-compatible client that times every token of one request.

One `RequestSpec` in, one `RequestResult` out. Failures (HTTP errors, broken streams, error
events, timeouts) come back as a result with `error` set; they never raise, so one bad request
cannot stop a benchmark.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp

COMPLETIONS = "completions"
CHAT = "chat"
ENDPOINT_PATHS: dict[str, str] = {COMPLETIONS: "/v1/completions", CHAT: "/v1/chat/completions"}


@dataclass
class RequestSpec:
    """One HTTP request to send. `prompt` is for completions, `messages` for chat."""

    endpoint: str
    max_tokens: int
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    headers: dict[str, str] = field(default_factory=dict)
    session_id: str | None = None
    turn: int = 0
    # What the workload meant to send; the server's usage is the truth when it reports one.
    planned_input_tokens: int = 0


@dataclass
class RequestResult:
    session_id: str | None = None
    turn: int = 0
    success: bool = False
    error: str = ""
    start_s: float = 0.0  # perf_counter() when the request was sent
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    e2el_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    usage_reported: bool = False
    generated_text: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first (vLLM's definition)."""
        if self.completion_tokens <= 1:
            return 0.0
        return (self.e2el_s - self.ttft_s) / (self.completion_tokens - 1)


@dataclass(frozen=True)
class ClientOptions:
    base_url: str
    model: str
    api_key: str | None = None
    ignore_eos: bool = False
    temperature: float = 0.0
    tool_choice: str | None = None
    request_timeout_s: float = 600.0
    extra_body: dict[str, Any] = field(default_factory=dict)


def build_payload(spec: RequestSpec, options: ClientOptions) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": options.model,
        "max_tokens": spec.max_tokens,
        "temperature": options.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if spec.endpoint == CHAT:
        payload["messages"] = spec.messages
        if spec.tools:
            payload["tools"] = spec.tools
            if options.tool_choice:
                payload["tool_choice"] = options.tool_choice
    else:
        payload["prompt"] = spec.prompt
    if options.ignore_eos:
        payload["ignore_eos"] = True
    payload.update(options.extra_body)
    return payload


def _delta_of(chunk: dict[str, Any], endpoint: str) -> tuple[str, list[dict[str, Any]]]:
    """The text and tool-call deltas of one SSE chunk (empty when it carries no token)."""
    choices = chunk.get("choices") or []
    if not choices:
        return "", []
    choice = choices[0]
    if endpoint == COMPLETIONS:
        return choice.get("text") or "", []
    delta = choice.get("delta") or {}
    text = (delta.get("content") or "") + (delta.get("reasoning_content") or delta.get("reasoning") or "")
    return text, list(delta.get("tool_calls") or [])


def _merge_tool_call_deltas(calls: list[dict[str, Any]], deltas: list[dict[str, Any]]) -> None:
    # Streamed tool calls arrive as fragments keyed by index; argument strings are concatenated.
    for delta in deltas:
        index = int(delta.get("index", len(calls)))
        while len(calls) <= index:
            calls.append({"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
        call = calls[index]
        if delta.get("id"):
            call["id"] = delta["id"]
        function = delta.get("function") or {}
        call["function"]["name"] += function.get("name") or ""
        call["function"]["arguments"] += function.get("arguments") or ""


def _read_usage(result: RequestResult, usage: dict[str, Any]) -> None:
    result.usage_reported = True
    result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    result.completion_tokens = int(usage.get("completion_tokens") or 0)
    details = usage.get("prompt_tokens_details") or {}
    result.cached_tokens = int(details.get("cached_tokens") or 0)


def _error_text(body: str) -> str:
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return body[:300]
    if isinstance(error, dict):
        return str(error.get("message", error))[:300]
    return str(error)[:300]


async def _sse_events(response: aiohttp.ClientResponse) -> AsyncIterator[tuple[bytes, float]]:
    """(data, arrival time) of each SSE `data:` line. Events that arrive in one socket read share
    its arrival time, as the client saw them; reading whole buffers keeps the client cheap."""
    pending = b""
    async for piece in response.content.iter_any():
        now_s = time.perf_counter()
        *lines, pending = (pending + piece).split(b"\n")
        for line in lines:
            if line.startswith(b"data:"):
                yield line[5:].strip(), now_s
    if pending.startswith(b"data:"):
        yield pending[5:].strip(), time.perf_counter()


async def send_request(
    session: aiohttp.ClientSession, spec: RequestSpec, options: ClientOptions
) -> RequestResult:
    """Send one streaming request and time it. Never raises except on cancellation."""
    result = RequestResult(session_id=spec.session_id, turn=spec.turn)
    url = options.base_url.rstrip("/") + ENDPOINT_PATHS[spec.endpoint]
    headers = {"Content-Type": "application/json", **spec.headers}
    if options.api_key:
        headers["Authorization"] = f"Bearer {options.api_key}"
    payload = build_payload(spec, options)
    timeout = aiohttp.ClientTimeout(total=options.request_timeout_s)
    text_parts: list[str] = []
    num_token_chunks = 0
    last_token_s = 0.0
    done = False
    result.start_s = time.perf_counter()
    try:
        async with session.post(url, json=payload, headers=headers, timeout=timeout) as response:
            if response.status != 200:
                body = await response.text()
                result.error = f"HTTP {response.status}: {_error_text(body)}"
                return result
            async for data, now_s in _sse_events(response):
                if data == b"[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    result.error = f"error event: {_error_text(data.decode())}"
                    return result
                if chunk.get("usage"):
                    _read_usage(result, chunk["usage"])
                text, tool_deltas = _delta_of(chunk, spec.endpoint)
                if not text and not tool_deltas:
                    continue
                if num_token_chunks == 0:
                    result.ttft_s = now_s - result.start_s
                else:
                    result.itl_s.append(now_s - last_token_s)
                last_token_s = now_s
                num_token_chunks += 1
                text_parts.append(text)
                _merge_tool_call_deltas(result.tool_calls, tool_deltas)
    except (aiohttp.ClientError, TimeoutError, ValueError, UnicodeDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:300]
        return result
    if not done:
        result.error = "stream ended before [DONE]"
        return result
    result.e2el_s = time.perf_counter() - result.start_s
    result.generated_text = "".join(text_parts)
    if not result.usage_reported:
        # Without usage, one streamed chunk is the best estimate of one token.
        result.completion_tokens = num_token_chunks
        result.prompt_tokens = spec.planned_input_tokens
    if num_token_chunks == 0 and result.completion_tokens > 0:
        result.error = "server reported completion tokens but streamed none"
        return result
    result.success = True
    return result
