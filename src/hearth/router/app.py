"""The router's request path: the lean HTTP front (`front.py`) in, the lean keep-alive client
(`upstream.py`) out; aiohttp only for health checks and `/v1/models`.

The request path is kept in one place and in plain sight: parse -> estimate -> choose -> record
the placement -> forward -> relay. Mixed requests forward the client's bytes untouched; only PD
requests are re-serialized (their bodies gain the protocol's fields).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from prometheus_client import CONTENT_TYPE_LATEST

from hearth.router.config import RouterConfig
from hearth.router.errors import error_response, error_response_for, sse_error_event_for
from hearth.router.front import HttpServer, Request, Response, StreamWriter, json_response
from hearth.router.health import HealthChecker
from hearth.router.metrics import RouterMetrics
from hearth.router.pd import PDAdapter, PDPair, make_pd_adapter
from hearth.router.policies import RouteRequest, RoutingPolicy, TokenAwarePolicy, make_policy
from hearth.router.prefix_index import CharBlockKeyer, PrefixKeyer, TokenPageKeyer
from hearth.router.sessions import ResponseOwners, response_id_in, session_key
from hearth.router.tokens import (
    TokenEstimator,
    make_estimator,
    max_output_tokens,
    prompt_text,
    prompt_token_ids,
)
from hearth.router.upstream import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamPool,
    UpstreamResponse,
)
from hearth.router.usage import (
    SSESplitter,
    by_source_of,
    cached_tokens_of,
    event_has_usage,
    rewrite_event,
    rewrite_json_body,
    usage_from_body,
)
from hearth.router.workers import Ticket, Worker, WorkerPool

log = logging.getLogger(__name__)

FORWARDED_HEADERS = (
    "authorization",
    "x-api-key",  # Anthropic clients authenticate with it
    "anthropic-version",
    "anthropic-beta",
    "x-request-id",
    "x-session-affinity",
)
RESPONSES_PATH = "/v1/responses"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
RETURNED_HEADERS = ("x-request-id",)
# aiohttp-client errors that mean a worker never answered (health checks, /v1/models).
CONNECT_ERRORS = (aiohttp.ClientConnectionError, asyncio.TimeoutError, OSError)
JSON_HEADER_LINE = b"content-type: application/json\r\n"
# The prefill answer's cached tokens and their split by source (None from a server without it).
PrefillCached = tuple[int, dict[str, int] | None]
PREFILL_HEALTH_POLL_S = 0.1  # how often a finished answer waiting for the prefill's usage checks its health


class UpstreamFailed(Exception):
    """A worker failed before sending its first byte."""


def forwarded_header_lines(request: Request) -> bytes | None:
    """The header lines sent upstream (content type + FORWARDED_HEADERS); None if a value is unsafe."""
    lines = [JSON_HEADER_LINE]
    for name in FORWARDED_HEADERS:
        value = request.headers.get(name)
        if value is not None:
            if "\r" in value or "\n" in value:
                return None
            lines.append(b"%s: %s\r\n" % (name.encode(), value.encode("latin-1")))
    return b"".join(lines)


class Router:
    def __init__(self, config: RouterConfig, pool: WorkerPool) -> None:
        self.config = config
        self.pool = pool
        self.policy: RoutingPolicy = make_policy(config.policy, config.balance)
        self.decode_policy = TokenAwarePolicy(config.balance)
        self.adapter: PDAdapter = make_pd_adapter(config.pd_protocol, config.kv_transfer_secret)
        self.estimator: TokenEstimator = make_estimator(config.tokenizer_dir)
        self.keyer: PrefixKeyer = (
            TokenPageKeyer(config.model_id, config.page_size)
            if config.tokenizer_dir
            else CharBlockKeyer(block_chars=config.page_size * 16)
        )
        self.metrics = RouterMetrics(pool)
        self.response_owners = ResponseOwners()
        self.session: aiohttp.ClientSession | None = None
        self.upstream = UpstreamPool(config.connect_timeout_s, config.read_timeout_s)
        self.health: HealthChecker | None = None
        self.server: HttpServer | None = None
        # Strong references to tasks nobody awaits (the loop keeps only weak ones).
        self._background: set[asyncio.Task[Any]] = set()

    # ---- lifecycle -------------------------------------------------------------------------

    async def serve(self, host: str, port: int, reuse_port: bool = False) -> int:
        """Start health checks and listen on host:port (0: any free port); returns the port."""
        await self.start()
        self.server = HttpServer()
        for method, path, handler in (
            ("POST", "/v1/chat/completions", self.generate),
            ("POST", "/v1/completions", self.generate),
            ("POST", RESPONSES_PATH, self.generate),
            ("POST", "/v1/messages", self.generate),
            ("POST", COUNT_TOKENS_PATH, self.generate),
            ("GET", "/v1/models", self.models),
            ("GET", "/health", self.healthz),
            ("GET", "/metrics", self.metrics_endpoint),
            ("GET", "/admin/workers", self.admin_list),
            ("POST", "/admin/workers", self.admin_add),
            ("DELETE", "/admin/workers", self.admin_remove),
        ):
            self.server.add_route(method, path, handler)
        for method in ("GET", "DELETE"):
            self.server.add_prefix_route(method, RESPONSES_PATH + "/", self.stored_response)
        return await self.server.start(host, port, reuse_port)

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, enable_cleanup_closed=True)
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=self.config.connect_timeout_s, sock_read=self.config.read_timeout_s
        )
        # The client's encoding passes through: no decompression, no cookie jar.
        self.session = aiohttp.ClientSession(
            connector=connector, timeout=timeout, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar()
        )
        self.health = HealthChecker(
            self.pool, self.session, self.config.health_interval_s, self.config.health_timeout_s
        )
        self.health.start()

    async def close(self) -> None:
        if self.server is not None:
            await self.server.close()
        if self.health is not None:
            await self.health.stop()
        await self.upstream.close()
        if self.session is not None:
            await self.session.close()

    # ---- the request path ------------------------------------------------------------------

    async def generate(self, request: Request) -> Response | StreamWriter:
        received_s = time.perf_counter()
        raw = request.body
        path = request.path
        try:
            body = json.loads(raw)
        except ValueError:
            return error_response_for(path, "request body is not valid JSON", 400)
        if not isinstance(body, dict):
            return error_response_for(path, "request body must be a JSON object", 400)
        headers = forwarded_header_lines(request)
        if headers is None:
            return error_response_for(path, "header values must not contain line breaks", 400)
        route = self._route_request(body, session_key(request.headers, body))
        stream = bool(body.get("stream"))
        if path == COUNT_TOKENS_PATH:  # no generation: any server can count
            role = next((r for r in ("mixed", "decode", "prefill") if self.pool.healthy(r)), "mixed")
            return await self._generate_mixed(request, raw, route, headers, False, received_s, role)
        owner = self._response_owner(body) if path == RESPONSES_PATH else None
        if owner is not None:
            # The worker that stored the conversation continues it, and holds its KV.
            return await self._generate_mixed(request, raw, route, headers, stream, received_s, owner=owner)
        if self.pool.healthy("prefill") and self.pool.healthy("decode"):
            return await self._generate_pd(request, body, route, headers, stream, received_s)
        if not self.pool.healthy("mixed") and self.pool.healthy("decode"):
            # No prefill server is healthy: a decode server computes the prompt itself (a body with no
            # kv_transfer field is an ordinary request to it), which beats answering 503.
            return await self._generate_mixed(request, raw, route, headers, stream, received_s, "decode")
        return await self._generate_mixed(request, raw, route, headers, stream, received_s)

    def _response_owner(self, body: dict[str, Any]) -> Worker | None:
        previous = body.get("previous_response_id")
        url = self.response_owners.owner(previous) if isinstance(previous, str) else None
        worker = self.pool.workers.get(url) if url is not None else None
        return worker if worker is not None and worker.healthy else None

    def _route_request(self, body: dict[str, Any], session_key: str | None) -> RouteRequest:
        text = prompt_text(body)
        token_ids = prompt_token_ids(body)
        if token_ids is None and self.config.tokenizer_dir:
            token_ids = self.estimator.encode(text)
        prompt_tokens = len(token_ids) if token_ids is not None else self.estimator.count(text)
        salt = body.get("cache_salt")
        keys = self.keyer.keys(text, token_ids, salt if isinstance(salt, str) else None)
        return RouteRequest(prompt_tokens, keys, self.keyer.tokens_per_key, session_key)

    def _place(self, route: RouteRequest, workers: list[Worker], policy: RoutingPolicy) -> tuple[Worker, int]:
        """Choose a worker and record the choice in its prefix index; returns it and its uncached tokens."""
        decision = policy.choose(route, workers)
        self.metrics.decided(decision.reason)
        worker = decision.worker
        matched_tokens = decision.matched_tokens or min(
            worker.prefix.match_blocks(route.block_keys) * route.tokens_per_key, route.prompt_tokens
        )
        worker.prefix.insert(route.block_keys)
        return worker, route.prompt_tokens - matched_tokens

    async def _generate_mixed(
        self,
        request: Request,
        raw: bytes,
        route: RouteRequest,
        headers: bytes,
        stream: bool,
        received_s: float,
        role: str = "mixed",
        owner: Worker | None = None,
    ) -> Response | StreamWriter:
        tried: set[str] = set()
        errors: list[str] = []
        for attempt in range(2):
            workers = [owner] if owner is not None and not attempt else self.pool.healthy(role)
            if tried:
                workers = [w for w in workers if w.url not in tried]
            if not workers:
                break
            if attempt:
                self.metrics.retries.inc()
            worker, uncached_tokens = self._place(route, workers, self.policy)
            tried.add(worker.url)
            ticket = worker.start(uncached_tokens, route.prompt_tokens)
            self.metrics.added_latency.observe(time.perf_counter() - received_s)
            try:
                upstream = await self._send(worker, request.path, raw, headers, ticket)
            except UpstreamFailed as exc:
                errors.append(str(exc))
                continue
            return await self._relay(request, upstream, [ticket], stream)
        cause = "; ".join(errors) or "no healthy worker"
        return error_response_for(
            request.path, f"no worker could take the request: {cause}", 503, "no_worker"
        )

    async def _send(
        self, worker: Worker, path: str, data: bytes, headers: bytes, ticket: Ticket
    ) -> UpstreamResponse:
        """POST to a worker until its headers arrive; a failure before then releases the ticket."""
        self.metrics.request_sent(worker.url)
        try:
            upstream = await self.upstream.request(worker.origin, path, headers, data)
        except (UpstreamError, asyncio.CancelledError) as exc:
            worker.finish(ticket)
            if isinstance(exc, asyncio.CancelledError):
                raise
            self.metrics.errors.labels(worker.url, "connect").inc()
            if isinstance(exc, UpstreamConnectError):
                # Nothing listens there: out until the health checker sees it answer again. (A broken
                # or slow connection says nothing certain about the worker, so it only costs a retry.)
                self.pool.set_healthy(worker, False)
            raise UpstreamFailed(f"{worker.url}: {type(exc).__name__}: {exc}") from exc
        if upstream.status >= 500:
            try:
                detail = (await upstream.read())[:200].decode(errors="replace")
            except UpstreamError as exc:
                detail = f"(body lost: {exc})"
            finally:
                upstream.release()
            worker.finish(ticket)
            self.metrics.errors.labels(worker.url, "status_5xx").inc()
            raise UpstreamFailed(f"{worker.url} answered {upstream.status}: {detail}")
        worker.last_ok_s = time.monotonic()
        return upstream

    async def _relay(
        self,
        request: Request,
        upstream: UpstreamResponse,
        tickets: list[Ticket],
        stream: bool,
        cached_tokens: Callable[[], Awaitable[PrefillCached | None]] | None = None,
    ) -> Response | StreamWriter:
        """Send the worker's answer to the client: chunk by chunk for SSE, whole otherwise.

        `cached_tokens`, in PD mode, yields the prefill side's cached tokens to write into usage.
        """
        headers = {name: upstream.headers[name] for name in RETURNED_HEADERS if name in upstream.headers}
        content_type = upstream.headers.get("content-type", "application/json")
        is_sse = content_type.startswith("text/event-stream")
        try:
            if not is_sse:
                try:
                    body = await upstream.read()
                except UpstreamError as exc:
                    self._count_error(tickets, "midstream")
                    return error_response_for(
                        request.path, f"worker failed while answering: {exc}", 502, "upstream_error"
                    )
                if cached_tokens is not None and upstream.status == 200:
                    cached = await cached_tokens()
                    if cached is not None:
                        body = rewrite_json_body(body, *cached)
                if request.path == RESPONSES_PATH and upstream.status == 200:
                    self._remember_response(body, tickets)
                return Response(upstream.status, body, content_type, headers)
            return await self._relay_stream(request, upstream, tickets, headers, cached_tokens)
        finally:
            upstream.release()
            for ticket in tickets:
                ticket.worker.finish(ticket)

    async def _relay_stream(
        self,
        request: Request,
        upstream: UpstreamResponse,
        tickets: list[Ticket],
        headers: dict[str, str],
        cached_tokens: Callable[[], Awaitable[PrefillCached | None]] | None,
    ) -> Response | StreamWriter:
        headers["content-type"] = "text/event-stream"
        headers["cache-control"] = "no-cache"
        response = await request.start_stream(upstream.status, headers)
        splitter = SSESplitter() if cached_tokens is not None else None
        first = True
        try:
            async for chunk in upstream.chunks():
                if first:
                    first = False
                    for ticket in tickets:
                        ticket.worker.first_token(ticket)
                    if request.path == RESPONSES_PATH and upstream.status == 200:
                        self._remember_response(chunk, tickets)
                if splitter is not None and cached_tokens is not None:
                    chunk = await self._rewrite_chunk(splitter, chunk, cached_tokens)
                    if not chunk:
                        continue
                await response.write(chunk)
            if splitter is not None:
                tail = splitter.flush()
                if tail:
                    await response.write(tail)
        except ConnectionResetError:
            return response  # the client left; releasing upstream aborts the worker's request
        except UpstreamError as exc:
            self._count_error(tickets, "midstream")
            log.warning("stream from %s broke: %r", tickets[-1].worker.url, exc)
            try:
                await response.write(
                    sse_error_event_for(request.path, f"worker failed mid-stream: {type(exc).__name__}")
                )
            except ConnectionResetError:
                return response
        try:
            await response.end()
        except ConnectionResetError:
            pass
        return response

    async def _rewrite_chunk(
        self,
        splitter: SSESplitter,
        chunk: bytes,
        cached_tokens: Callable[[], Awaitable[PrefillCached | None]],
    ) -> bytes:
        out: list[bytes] = []
        for event in splitter.feed(chunk):
            if event_has_usage(event):
                cached = await cached_tokens()
                if cached is not None:
                    event = rewrite_event(event, *cached)
            out.append(event)
        return b"".join(out)

    def _remember_response(self, data: bytes, tickets: list[Ticket]) -> None:
        response_id = response_id_in(data[:4096])
        if response_id is not None:
            self.response_owners.remember(response_id, tickets[-1].worker.url)

    def _count_error(self, tickets: list[Ticket], kind: str) -> None:
        for ticket in tickets:
            self.metrics.errors.labels(ticket.worker.url, kind).inc()

    # ---- PD --------------------------------------------------------------------------------

    async def _generate_pd(
        self,
        request: Request,
        body: dict[str, Any],
        route: RouteRequest,
        headers: bytes,
        stream: bool,
        received_s: float,
    ) -> Response | StreamWriter:
        if "x-request-id" not in request.headers:
            # Both sides of the pair, and the client, see one id.
            headers += b"x-request-id: %s\r\n" % secrets.token_hex(16).encode()
        tried: set[str] = set()
        errors: list[str] = []
        decode_route = RouteRequest(route.prompt_tokens, [], route.tokens_per_key, None)
        context_tokens = route.prompt_tokens + max_output_tokens(body) // 2
        for attempt in range(2):
            prefills = [w for w in self.pool.healthy("prefill") if w.url not in tried]
            decodes = [w for w in self.pool.healthy("decode") if w.url not in tried]
            if not prefills or not decodes:
                break
            if attempt:
                self.metrics.retries.inc()
            prefill, uncached_tokens = self._place(route, prefills, self.policy)
            decode, _ = self._place(decode_route, decodes, self.decode_policy)
            pair = PDPair(prefill, decode)
            prefill_ticket = prefill.start(uncached_tokens, 0)
            # The decode side receives the prompt as KV: no prefill of its own, only context.
            decode_ticket = decode.start(0, context_tokens)
            prefill_data = json.dumps(self.adapter.prefill_body(body, pair)).encode()
            self.metrics.added_latency.observe(time.perf_counter() - received_s)
            prefill_task = asyncio.create_task(
                self._run_prefill(prefill, request.path, prefill_data, headers, prefill_ticket)
            )
            try:
                prefill_result: dict[str, Any] | None = None
                if self.adapter.sequential:
                    prefill_result = await prefill_task
                    if prefill_result is None:
                        tried.add(prefill.url)
                        decode.finish(decode_ticket)
                        errors.append(f"prefill worker {prefill.url} failed")
                        continue
                decode_data = json.dumps(self.adapter.decode_body(body, pair, prefill_result)).encode()
                upstream = await self._send(decode, request.path, decode_data, headers, decode_ticket)
            except UpstreamFailed as exc:
                tried.add(decode.url)
                prefill_task.cancel()
                errors.append(str(exc))
                continue

            async def cached_tokens(
                task: asyncio.Task[dict[str, Any] | None] = prefill_task, worker: Worker = prefill
            ) -> PrefillCached | None:
                return await self._prefill_cached_tokens(task, worker)

            try:
                return await self._relay(request, upstream, [decode_ticket], stream, cached_tokens)
            finally:
                if not prefill_task.done():
                    # The prefill answer is only needed for usage; let it finish on its own.
                    self._background.add(prefill_task)
                    prefill_task.add_done_callback(self._background.discard)
        cause = "; ".join(errors) or "no healthy prefill/decode pair"
        return error_response_for(
            request.path, f"no prefill/decode pair could take the request: {cause}", 503, "no_worker"
        )

    async def _prefill_cached_tokens(
        self, task: asyncio.Task[dict[str, Any] | None], worker: Worker
    ) -> PrefillCached | None:
        """The prefill answer's cached tokens (and their split by source) for the decode answer's usage. A finished answer waits for
        them at most `prefill_usage_wait_s`, and not at all once the prefill server is seen unhealthy
        (stopped or gone): then the decode side's usage goes out as it is."""
        deadline_s = time.monotonic() + self.config.prefill_usage_wait_s
        while not task.done():
            remaining_s = deadline_s - time.monotonic()
            if remaining_s <= 0 or not worker.healthy:
                return None
            await asyncio.wait({task}, timeout=min(remaining_s, PREFILL_HEALTH_POLL_S))
        if task.cancelled() or task.exception() is not None:
            return None
        result = task.result()
        usage = result.get("usage") if result else None
        cached = cached_tokens_of(usage)
        return None if cached is None else (cached, by_source_of(usage))

    async def _run_prefill(
        self, worker: Worker, path: str, data: bytes, headers: bytes, ticket: Ticket
    ) -> dict[str, Any] | None:
        """The prefill side's answer as parsed JSON (usage, kv_transfer_params), or None if it failed."""
        try:
            upstream = await self._send(worker, path, data, headers, ticket)
            try:
                raw = await upstream.read()
            finally:
                upstream.release()
        except UpstreamFailed as exc:
            log.warning("PD prefill failed: %s", exc)
            return None
        except UpstreamError:
            self.metrics.errors.labels(worker.url, "midstream").inc()
            return None
        finally:
            worker.finish(ticket)
        if upstream.status != 200:
            self.metrics.errors.labels(worker.url, "status_4xx").inc()
            return None
        try:
            payload = json.loads(raw)
        except ValueError:
            usage = usage_from_body(raw)  # an SSE answer (SGLang's prefill streams when asked to)
            return {"usage": usage} if usage is not None else {}
        return payload if isinstance(payload, dict) else {}

    # ---- other endpoints -------------------------------------------------------------------

    async def stored_response(self, request: Request) -> Response | StreamWriter:
        """GET/DELETE /v1/responses/{id}[/input_items]: from the worker that stored it, else whichever has it."""
        assert self.session is not None
        response_id = request.path[len(RESPONSES_PATH) + 1 :].split("/", 1)[0]
        headers = {name: request.headers[name] for name in FORWARDED_HEADERS if name in request.headers}
        owner = self.response_owners.owner(response_id)
        candidates = [w for w in self.pool.workers.values() if w.healthy]
        candidates.sort(key=lambda w: w.url != owner)  # the owner first
        last: Response | None = None
        for worker in candidates:
            url = worker.url + request.path + (f"?{request.query_string}" if request.query_string else "")
            try:
                async with self.session.request(request.method, url, headers=headers) as upstream:
                    body = await upstream.read()
                    last = Response(
                        upstream.status, body, upstream.headers.get("content-type", "application/json")
                    )
            except CONNECT_ERRORS:
                self.metrics.errors.labels(worker.url, "connect").inc()
                continue
            if upstream.status != 404:
                if request.method == "DELETE" and upstream.status == 200:
                    self.response_owners.forget(response_id)
                return last
        return last or error_response("no healthy worker holds stored responses", 503, "no_worker")

    async def models(self, request: Request) -> Response | StreamWriter:
        assert self.session is not None
        headers = {name: request.headers[name] for name in FORWARDED_HEADERS if name in request.headers}
        candidates = self.pool.healthy("mixed") + self.pool.healthy("decode") + self.pool.healthy("prefill")
        for worker in candidates[:2]:
            try:
                async with self.session.get(worker.url + "/v1/models", headers=headers) as upstream:
                    body = await upstream.read()
                    if upstream.status >= 500:
                        continue
                    return Response(upstream.status, body)
            except CONNECT_ERRORS:
                self.metrics.errors.labels(worker.url, "connect").inc()
        return error_response("no healthy worker to list models", 503, "no_worker")

    async def healthz(self, request: Request) -> Response:
        healthy = sum(1 for w in self.pool.workers.values() if w.healthy)
        status = 200 if healthy else 503
        return json_response({"healthy_workers": healthy, "workers": len(self.pool.workers)}, status)

    async def metrics_endpoint(self, request: Request) -> Response:
        return Response(200, self.metrics.render(), CONTENT_TYPE_LATEST)

    # ---- admin -----------------------------------------------------------------------------

    def _admin_denied(self, request: Request) -> Response | None:
        key = self.config.admin_key
        if not key:
            return error_response("admin endpoints are disabled: start the router with --admin-key", 403)
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {key}".encode()):
            return error_response("admin endpoints need 'Authorization: Bearer <admin key>'", 401)
        return None

    async def admin_list(self, request: Request) -> Response:
        denied = self._admin_denied(request)
        if denied is not None:
            return denied
        return json_response({"workers": [w.describe() for w in self.pool.workers.values()]})

    async def admin_add(self, request: Request) -> Response:
        denied = self._admin_denied(request)
        if denied is not None:
            return denied
        try:
            data = request.json()
            url, role = data["url"], data.get("role", "mixed")
            bootstrap_port = data.get("bootstrap_port")
            if not isinstance(url, str) or (
                bootstrap_port is not None and not isinstance(bootstrap_port, int)
            ):
                raise TypeError("url must be a string and bootstrap_port an integer")
            worker = self.pool.add(url, role, bootstrap_port)
        except (ValueError, KeyError, TypeError) as exc:
            return error_response(f"cannot add worker: {exc}", 400)
        if self.health is not None:
            task = asyncio.create_task(self.health.check(worker))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        return json_response(worker.describe(), 201)

    async def admin_remove(self, request: Request) -> Response:
        denied = self._admin_denied(request)
        if denied is not None:
            return denied
        url = request.query.get("url")
        if url is None:
            try:
                url = request.json()["url"]
            except (ValueError, KeyError, TypeError):
                return error_response("name the worker: DELETE /admin/workers?url=...", 400)
        try:
            worker = self.pool.remove(str(url))
        except KeyError as exc:
            return error_response(str(exc.args[0]), 404)
        self.upstream.drop(worker.origin)
        return json_response(worker.describe())
