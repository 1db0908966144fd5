"""A fake OpenAI-compatible server with known delays, for testing and calibrating the bench client.

It streams `max_tokens` one-word tokens after `ttft_s`, one every `itl_s`, reports usage with a
simulated prefix cache (16-word pages, hash chain), and can fail every Nth request with HTTP 500
or cut every Nth stream short. With zero delays it measures how fast the client can drive load:

    python -m hearth.bench.fake_server --port 19001
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

PAGE_WORDS = 16


@dataclass
class FakeServerConfig:
    ttft_s: float = 0.0
    itl_s: float = 0.0
    fail_every: int = 0  # every Nth request answers HTTP 500 (0: never)
    drop_every: int = 0  # every Nth stream stops after two tokens without [DONE] (0: never)
    record_requests: bool = True


@dataclass
class FakeServerState:
    config: FakeServerConfig
    requests: list[dict[str, Any]] = field(default_factory=list)  # {"headers", "body"} per request
    num_requests: int = 0
    cached_pages: set[bytes] = field(default_factory=set)


def prompt_words(body: dict[str, Any]) -> list[str]:
    """The fake tokenizer: one token per whitespace-separated word (or per id in an id list)."""
    if "messages" in body:
        words: list[str] = []
        if body.get("tools"):
            words += json.dumps(body["tools"]).split()
        for message in body["messages"]:
            words.append(f"<{message.get('role')}>")
            words += str(message.get("content") or "").split()
            if message.get("tool_calls"):
                words += json.dumps(message["tool_calls"]).split()
        return words
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        return [str(token_id) for token_id in prompt]
    return str(prompt).split()


def cached_prefix_words(state: FakeServerState, words: list[str]) -> int:
    """Words in full pages already seen, as a prefix cache with a hash chain would find them."""
    key = b""
    num_cached = 0
    still_hitting = True
    for start in range(0, len(words) - len(words) % PAGE_WORDS, PAGE_WORDS):
        key = hashlib.blake2b(
            key + " ".join(words[start : start + PAGE_WORDS]).encode(), digest_size=16
        ).digest()
        if still_hitting and key in state.cached_pages:
            num_cached += PAGE_WORDS
        else:
            still_hitting = False
            state.cached_pages.add(key)
    return num_cached


STATE_KEY = web.AppKey("state", FakeServerState)


def _error(status: int, message: str) -> web.Response:
    body = {"error": {"message": message, "type": "invalid_request_error", "code": status}}
    return web.json_response(body, status=status)


async def _completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    config = state.config
    try:
        body = await request.json()
    except ValueError:
        return _error(400, "body is not JSON")
    if not isinstance(body, dict) or not isinstance(body.get("max_tokens", 16), int):
        return _error(400, "max_tokens must be an integer")
    state.num_requests += 1
    index = state.num_requests
    if config.record_requests:
        state.requests.append({"headers": dict(request.headers), "body": body, "path": request.path})
    if config.fail_every and index % config.fail_every == 0:
        return web.json_response({"error": {"message": f"injected failure {index}", "code": 500}}, status=500)
    is_chat = request.path.endswith("/chat/completions")
    words = prompt_words(body)
    num_cached = cached_prefix_words(state, words)
    num_output = max(0, int(body.get("max_tokens", 16)))
    usage = {
        "prompt_tokens": len(words),
        "completion_tokens": num_output,
        "total_tokens": len(words) + num_output,
        "prompt_tokens_details": {"cached_tokens": num_cached},
    }
    created = int(time.time())
    object_name = "chat.completion.chunk" if is_chat else "text_completion"
    if not body.get("stream"):
        text = " ".join(f"w{i}" for i in range(num_output))
        choice = {"index": 0, "finish_reason": "length"}
        choice.update({"message": {"role": "assistant", "content": text}} if is_chat else {"text": text})
        return web.json_response({"id": f"fake-{index}", "object": object_name.removesuffix(".chunk"),
                                  "created": created, "model": body.get("model"), "choices": [choice],
                                  "usage": usage})  # fmt: skip

    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)

    async def send(choices: list[dict[str, Any]], chunk_usage: dict[str, Any] | None = None) -> None:
        chunk = {"id": f"fake-{index}", "object": object_name, "created": created, "model": body.get("model"),
                 "choices": choices, "usage": chunk_usage}  # fmt: skip
        await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")

    if config.ttft_s > 0:
        await asyncio.sleep(config.ttft_s)
    for i in range(num_output):
        if i > 0 and config.itl_s > 0:
            await asyncio.sleep(config.itl_s)
        if config.drop_every and index % config.drop_every == 0 and i == 2:
            return response  # the stream ends without [DONE], as when a server dies mid-answer
        text = f" w{i}"
        finish = "length" if i == num_output - 1 else None
        if is_chat:
            delta: dict[str, Any] = {"content": text} if i else {"role": "assistant", "content": text}
            await send([{"index": 0, "delta": delta, "finish_reason": finish}])
        else:
            await send([{"index": 0, "text": text, "finish_reason": finish}])
    if (body.get("stream_options") or {}).get("include_usage"):
        await send([], usage)
    await response.write(b"data: [DONE]\n\n")
    return response


async def _models(request: web.Request) -> web.Response:
    # `num_requests` lets tests wait for traffic instead of sleeping a guessed time.
    num_requests = request.app[STATE_KEY].num_requests
    return web.json_response(
        {"object": "list", "data": [{"id": "fake", "object": "model"}], "num_requests": num_requests}
    )


def make_app(config: FakeServerConfig) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[STATE_KEY] = FakeServerState(config)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _completions)
    app.router.add_get("/v1/models", _models)
    return app


async def start_fake_server(config: FakeServerConfig, port: int = 0) -> tuple[web.AppRunner, str]:
    """Start on 127.0.0.1 (port 0: any free port); returns the runner (call `cleanup()`) and base URL."""
    runner = web.AppRunner(make_app(config), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    bound_port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{bound_port}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--ttft-ms", type=float, default=0.0)
    parser.add_argument("--itl-ms", type=float, default=0.0)
    parser.add_argument("--fail-every", type=int, default=0)
    parser.add_argument("--drop-every", type=int, default=0)
    args = parser.parse_args()
    config = FakeServerConfig(
        ttft_s=args.ttft_ms / 1000, itl_s=args.itl_ms / 1000, fail_every=args.fail_every,
        drop_every=args.drop_every, record_requests=False,
    )  # fmt: skip

    async def serve() -> None:
        runner, url = await start_fake_server(config, args.port)
        print(f"fake OpenAI server listening on {url}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
