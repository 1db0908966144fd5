"""The FastAPI app: routes, API-key check, OpenAI-shaped errors, and loading the engine in the background so
`/health` can say "loading" instead of refusing connections."""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import logging
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

import hearth
from hearth.server.admission import AdmissionController
from hearth.server.chat_template import ChatTemplate, ChatTemplateError, content_chars, normalize_messages
from hearth.server.disconnect import QuietDisconnectMiddleware
from hearth.server.errors import APIError, bad_request, error_body, from_validation_error
from hearth.server.limits import read_body, too_large
from hearth.server.messages_protocol import CountTokensRequest, MessagesRequest
from hearth.server.metrics import ServerMetrics
from hearth.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from hearth.server.reasoning_parsers import get_reasoning_parser
from hearth.server.response_store import ResponseStore
from hearth.server.responses_protocol import ResponsesRequest
from hearth.server.serving_chat import create_chat_completion
from hearth.server.serving_completion import create_completion
from hearth.server.serving_messages import anthropic_error, count_tokens, create_message
from hearth.server.serving_responses import create_response, delete_response, get_response, input_items
from hearth.server.state import ServerConfig, ServerState
from hearth.server.tokenization import PromptTokenizer
from hearth.server.tool_parsers import get_tool_parser

if TYPE_CHECKING:
    from hearth.engine.async_engine import AsyncEngine

logger = logging.getLogger("hearth.server")

ModelT = TypeVar("ModelT", bound=BaseModel)


# Endpoints that do work for a client (tokenizing is as costly as a prompt) need the key like /v1/*.
_KEYED_PATHS = ("/tokenize", "/detokenize")


class ApiKeyMiddleware:
    """`Authorization: Bearer <key>` (or Anthropic's `x-api-key: <key>`) on `/v1/*`, `/tokenize` and
    `/detokenize`; health, metrics and load stay open for probes."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        self._expected_key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"] if scope["type"] == "http" else ""
        if path.startswith("/v1/") or path in _KEYED_PATHS:
            headers = dict(scope["headers"])
            given = headers.get(b"authorization", b"")
            given_key = headers.get(b"x-api-key", b"")
            if not (
                hmac.compare_digest(given, self._expected)
                or hmac.compare_digest(given_key, self._expected_key)
            ):
                error = APIError(
                    "Incorrect or missing API key; send `Authorization: Bearer <key>` or `x-api-key: <key>`",
                    401,
                    "invalid_request_error",
                    code="invalid_api_key",
                )
                response = anthropic_error(error) if path.startswith("/v1/messages") else error.response()
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class RequestIdMiddleware:
    """Echoes a client's `X-Request-Id` on the response (as vLLM does), so a client or proxy can match them."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = next((value for key, value in scope["headers"] if key == b"x-request-id"), None)
        text = request_id.decode("latin-1") if request_id is not None else ""
        if not text or len(text) > 256 or not text.isascii() or not text.isprintable():
            await self.app(scope, receive, send)
            return

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


async def _parse(
    raw: Request, model: type[ModelT], config: ServerConfig, prompts: PromptTokenizer | None = None
) -> ModelT:
    """The body as `model`; with `prompts` (endpoints that take a prompt), one too long to fit the
    context is refused from its Content-Length first."""
    declared = raw.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > config.max_request_bytes:
        raise too_large(config.max_request_bytes)  # the server's own limit is named first
    if prompts is not None:
        prompts.check_body_fits(declared)
    body = await read_body(raw, config.max_request_bytes, config.body_read_timeout_s)
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from exc


def _attach_engine(state: ServerState, engine: AsyncEngine, model_dir: str) -> None:
    state.prompts = PromptTokenizer(
        engine.tokenizer, engine.max_model_len, state.config.allow_special_tokens_in_content
    )
    try:
        state.chat_template = ChatTemplate.from_dir(
            state.config.tokenizer_dir or model_dir, state.config.chat_template_path
        )
        if state.tool_parser is not None:
            state.tool_parser.adapt_to_template(state.chat_template.source)
    except (ChatTemplateError, OSError) as exc:
        state.chat_template_error = str(exc)
        logger.warning("chat completions disabled: %s", exc)
    state.engine = engine
    logger.info(
        "ready: serving %r, KV cache holds %d tokens, context %d tokens",
        state.config.model_name,
        engine.num_kv_tokens,
        engine.max_model_len,
    )


def build_app(
    config: ServerConfig,
    engine_factory: Callable[[], AsyncEngine],
    model_dir: str,
    max_running_seqs: int,
    on_load_failure: Callable[[BaseException], None] | None = None,
) -> FastAPI:
    """The app for one server. The engine is built by `engine_factory` in a thread once the app starts."""
    state_box: dict[str, ServerState] = {}
    metrics = ServerMetrics(config.model_name, lambda: state_box["state"].stats())
    state = ServerState(
        config=config,
        metrics=metrics,
        admission=AdmissionController(max_running_seqs, config.max_waiting_seqs),
        tool_parser=get_tool_parser(config.tool_parser) if config.tool_parser else None,
        reasoning_parser=get_reasoning_parser(config.reasoning_parser) if config.reasoning_parser else None,
        responses=ResponseStore(config.max_stored_responses, config.stored_response_ttl_s),
    )
    state_box["state"] = state
    if config.role == "prefill":
        from hearth.server.pd import KVPeers

        state.kv_peers = KVPeers(config.kv_transfer)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        starting: concurrent.futures.Future[AsyncEngine] = concurrent.futures.Future()

        def start_engine() -> None:
            if not starting.set_running_or_notify_cancel():
                return
            try:
                starting.set_result(engine_factory())
            except BaseException as exc:
                starting.set_exception(exc)

        async def load() -> None:
            threading.Thread(target=start_engine, name="hearth-engine-start", daemon=True).start()
            try:
                engine = await asyncio.wrap_future(starting)
            except asyncio.CancelledError:
                return  # stopped while loading (Ctrl-C, SIGTERM): not a load failure
            except Exception as exc:  # a model that fails to load ends the server with a message
                state.load_error = str(exc)
                logger.error("could not load the model: %s", exc)
                if on_load_failure is not None:
                    on_load_failure(exc)
                return
            # Off the loop: building the chat template and the tokenizer's copies takes a moment.
            await asyncio.to_thread(_attach_engine, state, engine, model_dir)

        loader = asyncio.create_task(load())
        yield
        state.admission.draining = True
        if not loader.done():
            loader.cancel()
            # Stopped while the engine starts: stop it once it is up rather than leave its process behind.
            starting.add_done_callback(lambda done: None if done.exception() else done.result().shutdown())
        if state.engine is not None:
            await asyncio.to_thread(state.engine.shutdown)
        if state.kv_peers is not None:
            await state.kv_peers.close()

    app = FastAPI(title="Hearth", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.hearth = state
    if config.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    app.add_middleware(RequestIdMiddleware)
    app.add_middleware(QuietDisconnectMiddleware)  # added last: outermost of ours

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> Response:
        logger.exception("unhandled error", exc_info=exc)
        return JSONResponse(
            error_body(f"internal error: {type(exc).__name__}", "internal_error"), status_code=500
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Response:
        return await create_chat_completion(
            state, await _parse(raw, ChatCompletionRequest, config, state.prompts), raw
        )

    @app.post("/v1/responses")
    async def responses(raw: Request) -> Response:
        return await create_response(state, await _parse(raw, ResponsesRequest, config, state.prompts), raw)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, raw: Request) -> dict[str, Any]:
        return get_response(state, response_id, raw)

    @app.delete("/v1/responses/{response_id}")
    async def remove_response(response_id: str, raw: Request) -> dict[str, Any]:
        return delete_response(state, response_id, raw)

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(response_id: str, raw: Request) -> dict[str, Any]:
        return input_items(state, response_id, raw)

    @app.post("/v1/messages")
    async def messages(raw: Request) -> Response:
        try:
            request = await _parse(raw, MessagesRequest, config, state.prompts)
            return await create_message(state, request, raw)
        except APIError as exc:
            return anthropic_error(exc)
        except Exception as exc:
            logger.exception("unhandled error", exc_info=exc)
            return anthropic_error(APIError(f"internal error: {type(exc).__name__}", 500, "internal_error"))

    @app.post("/v1/messages/count_tokens")
    async def messages_count_tokens(raw: Request) -> Response:
        try:
            request = await _parse(raw, CountTokensRequest, config, state.prompts)
            return JSONResponse(await count_tokens(state, request))
        except APIError as exc:
            return anthropic_error(exc)
        except Exception as exc:
            logger.exception("unhandled error", exc_info=exc)
            return anthropic_error(APIError(f"internal error: {type(exc).__name__}", 500, "internal_error"))

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        return await create_completion(
            state, await _parse(raw, CompletionRequest, config, state.prompts), raw
        )

    def model_card() -> dict[str, Any]:
        max_model_len = state.engine.max_model_len if state.engine is not None else None
        return {
            "id": config.model_name,
            "object": "model",
            "created": state.created_s,
            "owned_by": "hearth",
            "root": model_dir,
            "max_model_len": max_model_len,
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        state.check_model(model_id)
        return model_card()

    @app.get("/health")
    async def health() -> Response:
        error = state.engine_error
        if error is not None:
            return JSONResponse({"status": "failed", "error": error}, status_code=503)
        if not state.ready:
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": hearth.__version__}

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        """vLLM's (and SageMaker's) liveness probe: as /health, with an empty body."""
        ready = state.engine_error is None and state.ready
        return Response(status_code=200 if ready else 503)

    @app.get("/kv_transfer/endpoint")
    async def kv_transfer_endpoint() -> dict[str, Any]:
        """Where prefill servers send this decode server's KV (docs/pd-protocol.md)."""
        engine = state.require_engine()
        endpoint = getattr(engine, "kv_transfer_endpoint", None)
        if config.role != "decode" or endpoint is None:
            raise APIError("this server is not a decode server", 404, "not_found_error")
        return {"role": "decode", "transport": config.kv_transfer, "endpoint": endpoint}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/load")
    async def load_report() -> dict[str, int]:
        stats = state.stats()
        return {
            "running_requests": stats.num_running if stats else 0,
            "waiting_requests": stats.num_waiting if stats else 0,
            "prefill_tokens": state.load.prefill_tokens,
            "decode_tokens": state.load.decode_tokens,
            "kv_pages_used": stats.kv_pages_used if stats else 0,
            "kv_pages_total": stats.kv_pages_total if stats else 0,
        }

    @app.post("/tokenize")
    async def tokenize(raw: Request) -> dict[str, Any]:
        request = await _parse(raw, TokenizeRequest, config, state.prompts)
        state.check_model(request.model)
        engine = state.require_engine()
        prompts = state.require_prompts()
        if request.messages is not None:
            if state.chat_template is None:
                raise bad_request(state.chat_template_error or "this model has no chat template", "messages")
            template = state.chat_template
            messages, tools = request.messages, request.tools
            num_chars = content_chars(messages)
            prompts.check_fits(num_chars, "messages")

            def render_and_encode() -> list[int]:
                try:
                    text = template.render(
                        prompts.escape_specials(
                            normalize_messages([m.model_dump(exclude_unset=True) for m in messages])
                        ),
                        tools=prompts.escape_specials(
                            [tool.model_dump(exclude_unset=True) for tool in tools] if tools else None
                        ),
                        add_generation_prompt=request.add_generation_prompt,
                    )
                except ChatTemplateError as exc:
                    raise bad_request(str(exc), "messages") from exc
                prompts.check_fits(len(text), "messages")
                return prompts.encode_chat(text)

            tokens = await prompts.run(num_chars, render_and_encode)
        else:
            tokens = await prompts.encode(request.prompt or "", request.add_special_tokens, "prompt")
        return {"tokens": tokens, "count": len(tokens), "max_model_len": engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(raw: Request) -> dict[str, Any]:
        request = await _parse(raw, DetokenizeRequest, config)
        state.check_model(request.model)
        tokenizer = state.require_engine().tokenizer
        if request.tokens and max(request.tokens) >= tokenizer.vocab_size:
            raise bad_request(f"token ids must be below the vocabulary size {tokenizer.vocab_size}", "tokens")
        return {"prompt": tokenizer.decode(request.tokens, skip_special_tokens=False)}

    return app
