"""Fake OpenAI-compatible workers for the router's tests and overhead benchmark.

A fake worker answers at once (or after `delay_s` per chunk) with a fixed completion, and can
speak one side of a PD protocol (hearth, sglang, vllm) the way a real server would: the hearth
prefill pushes a "KV" notice to the decode server, the sglang pair meets in a bootstrap room,
the vllm decode checks the `kv_transfer_params` its prefill handed out.

    python scripts/router_fake_worker.py --port 18101 [--port 18102 ...]   # one process, many workers
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

FAKE_KEY: web.AppKey[FakeWorker] = web.AppKey("fake_worker")


@dataclass
class Rendezvous:
    """Where fake prefill and decode workers of one test meet (stands in for the KV transport)."""

    events: dict[str, asyncio.Event] = field(default_factory=dict)

    def event(self, key: str) -> asyncio.Event:
        return self.events.setdefault(key, asyncio.Event())


@dataclass
class FakeWorker:
    name: str = "w"
    role: str = "mixed"  # mixed | prefill | decode
    protocol: str = "hearth"  # for PD roles: hearth | sglang | vllm
    cached_tokens: int = 0
    num_chunks: int = 3
    delay_s: float = 0.0
    fail: str | None = None  # None | "500" | "midstream" | "hang_midstream" | "refuse_health"
    load_report: dict[str, int] | None = None
    rendezvous: Rendezvous | None = None
    # When set, a stream pauses after its first chunk until the test opens the gate.
    gate: asyncio.Event | None = None
    requests: list[dict[str, Any]] = field(default_factory=list)
    headers_seen: list[dict[str, str]] = field(default_factory=list)
    # Streams whose reader (the router) hung up before the end: the worker's request was aborted.
    streams_aborted: int = 0

    def build_app(self) -> web.Application:
        app = web.Application()
        app[FAKE_KEY] = self
        app.router.add_post("/v1/chat/completions", self.generate)
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/load", self.load)
        app.router.add_post("/kv_transfer/{transfer_id}", self.receive_kv)
        return app

    async def health(self, request: web.Request) -> web.Response:
        if self.fail == "refuse_health":
            return web.Response(status=503)
        return web.Response(text="ok")

    async def load(self, request: web.Request) -> web.Response:
        if self.load_report is None:
            return web.Response(status=404)
        return web.json_response(self.load_report)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def receive_kv(self, request: web.Request) -> web.Response:
        assert self.rendezvous is not None
        self.rendezvous.event("hearth:" + request.match_info["transfer_id"]).set()
        return web.json_response({"ok": True})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        self.headers_seen.append(dict(request.headers))
        if self.fail == "500":
            return web.json_response({"error": {"message": "boom", "type": "server_error"}}, status=500)
        extra: dict[str, Any] = {}
        if self.role == "prefill":
            problem, extra = await self._prefill_side(body, request)
        elif self.role == "decode":
            problem = await self._decode_side(body)
        else:
            problem = None
        if problem:
            return web.json_response(
                {"error": {"message": problem, "type": "invalid_request_error"}}, status=400
            )
        chat = request.path.endswith("chat/completions")
        prompt_tokens = len(json.dumps(body.get("messages") or body.get("prompt") or "")) // 4
        if body.get("stream"):
            return await self._stream(request, body, chat, prompt_tokens)
        payload = self._completion(chat, prompt_tokens, self.num_chunks)
        payload.update(extra)
        return web.json_response(payload)

    async def _prefill_side(
        self, body: dict[str, Any], request: web.Request
    ) -> tuple[str | None, dict[str, Any]]:
        assert self.rendezvous is not None
        if self.protocol == "hearth":
            kv = body.get("kv_transfer") or {}
            if kv.get("role") != "prefill" or body.get("max_tokens") != 1 or body.get("stream"):
                return "hearth prefill needs kv_transfer.role=prefill, max_tokens=1, stream=false", {}
            # "Push the KV" to the decode server named in the request, over HTTP as a real one would.
            async with aiohttp.ClientSession() as session:
                async with session.post(f"{kv['decode_url']}/kv_transfer/{kv['transfer_id']}") as resp:
                    if resp.status != 200:
                        return f"decode server refused the KV: {resp.status}", {}
            return None, {"kv_transfer": {"transfer_id": kv["transfer_id"], "status": "sent"}}
        if self.protocol == "sglang":
            if not isinstance(body.get("bootstrap_room"), int) or body.get("bootstrap_port") is None:
                return "sglang prefill needs bootstrap_host/port/room", {}
            self.rendezvous.event(f"sglang:{body['bootstrap_room']}").set()
            return None, {}
        params = body.get("kv_transfer_params") or {}
        if not params.get("do_remote_decode") or body.get("max_tokens") != 1:
            return "vllm prefill needs kv_transfer_params.do_remote_decode and max_tokens=1", {}
        handed = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.name,
            "remote_block_ids": [3, 1, 4],
            "remote_host": "127.0.0.1",
            "remote_port": 5600,
        }
        return None, {"kv_transfer_params": handed}

    async def _decode_side(self, body: dict[str, Any]) -> str | None:
        assert self.rendezvous is not None
        if self.protocol == "hearth":
            kv = body.get("kv_transfer") or {}
            if kv.get("role") != "decode" or not kv.get("prefill_url"):
                return "hearth decode needs kv_transfer.role=decode and prefill_url"
            key = "hearth:" + kv["transfer_id"]
        elif self.protocol == "sglang":
            key = f"sglang:{body.get('bootstrap_room')}"
        else:
            params = body.get("kv_transfer_params") or {}
            if not params.get("do_remote_prefill") or params.get("remote_block_ids") != [3, 1, 4]:
                return "vllm decode needs the kv_transfer_params its prefill returned"
            return None
        try:
            await asyncio.wait_for(self.rendezvous.event(key).wait(), 5.0)
        except asyncio.TimeoutError:
            return f"no KV arrived for {key}"
        return None

    def _usage(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    def _completion(self, chat: bool, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        text = " ".join(f"tok{i}" for i in range(completion_tokens))
        choice: dict[str, Any] = {"index": 0, "finish_reason": "stop"}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {
            "id": f"cmpl-{self.name}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": "fake-model",
            "choices": [choice],
            "usage": self._usage(prompt_tokens, completion_tokens),
            "worker": self.name,
        }

    async def _stream(
        self, request: web.Request, body: dict[str, Any], chat: bool, prompt_tokens: int
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        try:
            await self._stream_events(request, response, body, chat, prompt_tokens)
        except ConnectionResetError:
            self.streams_aborted += 1
        except asyncio.CancelledError:
            self.streams_aborted += 1  # served with handler_cancellation: a hang-up cancels the handler
            raise
        return response

    async def _stream_events(
        self,
        request: web.Request,
        response: web.StreamResponse,
        body: dict[str, Any],
        chat: bool,
        prompt_tokens: int,
    ) -> None:
        kind = "chat.completion.chunk" if chat else "text_completion"
        for i in range(self.num_chunks):
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            if i == 2 and self.fail in ("midstream", "hang_midstream"):
                if self.fail == "hang_midstream":
                    await asyncio.sleep(3600)
                assert request.transport is not None
                request.transport.close()
                return
            choice: dict[str, Any] = {"index": 0, "finish_reason": None}
            if chat:
                choice["delta"] = {"content": f"tok{i} "}
            else:
                choice["text"] = f"tok{i} "
            chunk = {"id": f"cmpl-{self.name}", "object": kind, "model": "fake-model", "choices": [choice]}
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            if i == 0 and self.gate is not None:
                await self.gate.wait()
            if request.transport is None or request.transport.is_closing():
                raise ConnectionResetError("the reader hung up")
        if (body.get("stream_options") or {}).get("include_usage"):
            final = {
                "id": f"cmpl-{self.name}",
                "object": kind,
                "model": "fake-model",
                "choices": [],
                "usage": self._usage(prompt_tokens, self.num_chunks),
            }
            await response.write(b"data: " + json.dumps(final).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()


async def serve_app(app: web.Application, port: int = 0) -> tuple[web.AppRunner, str]:
    """Serve `app` on 127.0.0.1 (port 0: any free port); returns the runner and the base URL."""
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    server = site._server
    assert server is not None and server.sockets
    return runner, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def _serve(ports: list[int], num_chunks: int) -> None:
    runners = []
    for port in ports:
        runner = web.AppRunner(
            FakeWorker(name=f"w{port}", num_chunks=num_chunks).build_app(), access_log=None
        )
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
    print(f"fake workers on {ports}", flush=True)
    await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, action="append", required=True)
    parser.add_argument("--num-chunks", type=int, default=3)
    args = parser.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(_serve(args.port, args.num_chunks))


if __name__ == "__main__":
    main()
