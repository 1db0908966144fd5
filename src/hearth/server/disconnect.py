"""Clients that leave: their requests are aborted and everything they held is released."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.utils import ClientDisconnected

logger = logging.getLogger("hearth.server")

# What sending to (or reading from) a client that has gone raises. Clients leave all the time: a debug
# line, not an ERROR traceback (3,000 disconnects used to write 22 MB of them).
CLIENT_GONE = (ClientDisconnect, ClientDisconnected, ConnectionError)


class QuietDisconnectMiddleware:
    """A client that left while its request was read or answered ends the request with a debug line; past
    this middleware it would be an "Exception in ASGI application" ERROR with a traceback."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.app(scope, receive, send)
        except CLIENT_GONE as exc:
            logger.debug("client left: %r", exc)


class StreamingResponseWithCleanup(StreamingResponse):
    """A stream whose generator is closed (aborting its engine requests) and `on_close` called however the
    response ends: finished, failed to send because the client left, or never started."""

    def __init__(self, content: Any, on_close: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except CLIENT_GONE as exc:
            logger.debug("client left during a stream: %r", exc)
        finally:
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
            self._on_close()


async def _wait_for_disconnect(raw: Request) -> None:
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(work: Awaitable[Response], raw: Request) -> Response:
    """Await `work`, cancelling it (and so aborting its engine requests) if the client disconnects first.

    A non-streaming request would otherwise keep generating for nobody until it finished.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
    if task.cancelled() or not task.done():
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return Response(status_code=499)  # nobody reads it; the status is for the access log
    return task.result()


async def respond(
    raw: Request,
    stream: bool,
    events: Callable[[], AsyncIterator[str]],
    complete: Callable[[], Awaitable[Response]],
    close: Callable[[], None],
) -> Response:
    """The one shape of every generation endpoint: an SSE stream, or the whole answer awaited until
    the client leaves; `close` (abort whatever is still running) runs when either ends."""
    if stream:
        return StreamingResponseWithCleanup(events(), close, media_type="text/event-stream")
    try:
        return await run_until_disconnect(complete(), raw)
    finally:
        close()
