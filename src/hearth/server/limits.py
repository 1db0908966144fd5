"""Limits on what a client may send and how slowly: body size (413), body read time (408), header read time.

A 200 MB body used to be read whole and a half-sent request held a connection (and its buffers) forever.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import Request

from hearth.server.errors import APIError

logger = logging.getLogger("hearth.server")


def too_large(max_request_bytes: int) -> APIError:
    return APIError(
        f"the request body is larger than this server's limit of {max_request_bytes} bytes "
        "(--max-request-bytes)",
        413,
        "invalid_request_error",
        code="request_too_large",
    )


async def read_body(raw: Request, max_request_bytes: int, timeout_s: float) -> bytes:
    """The whole body, refused with 413 past `max_request_bytes` (from Content-Length before reading, else
    while reading) and with 408 when it has not all arrived within `timeout_s`."""
    declared = raw.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_request_bytes:
        raise too_large(max_request_bytes)

    async def receive_all() -> bytes:
        chunks: list[bytes] = []
        size = 0
        async for chunk in raw.stream():
            size += len(chunk)
            if size > max_request_bytes:
                raise too_large(max_request_bytes)
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        return await asyncio.wait_for(receive_all(), timeout_s)
    except TimeoutError as exc:
        raise APIError(
            f"the request body did not arrive within {timeout_s:g} s",
            408,
            "invalid_request_error",
            code="request_timeout",
            headers={"Connection": "close"},
        ) from exc


def header_timeout_protocol(header_read_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol with a deadline for the request line and headers: a client that opens
    a connection (or starts a request) and sends its headers slower than this is disconnected. uvicorn
    itself only times out idle keep-alive connections."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HeaderTimeoutProtocol(HttpToolsProtocol):
        _header_deadline: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            if self._header_deadline is None:
                self._header_deadline = self.loop.call_later(header_read_timeout_s, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._header_deadline is not None:
                self._header_deadline.cancel()
                self._header_deadline = None

        def _headers_too_slow(self) -> None:
            self._header_deadline = None
            logger.debug("closing a connection whose request headers took over %g s", header_read_timeout_s)
            if not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeaderTimeoutProtocol
