"""A lean HTTP/1.1 client for the router's hot path: keep-alive connections per worker, parsed by httptools.

Why not aiohttp's ClientSession here: measured on the 2-vCPU dev VM it burns ~0.2 ms of CPU per
proxied request (URL and header objects, the payload registry, tracing hooks, a timer per read),
as much as the router's HTTP front and routing together, and a proxy needs none of it: it sends
bytes it already holds and relays the bytes that come back. Parsing stays in a library
(`httptools`, the llhttp parser uvicorn uses); this module only keeps connections and frames
requests. Health checks and `/v1/models` keep aiohttp, where convenience is worth more than CPU.

Contract of a request: `UpstreamPool.request()` returns once the status line and headers are in;
the caller then reads the body (`read()` or `chunks()`) and must call `release()` exactly once
(in a `finally`). A connection goes back to the pool only when its answer was read to the end
and the worker allows keep-alive; releasing early closes it, which aborts the worker's request.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httptools
from yarl import URL

# A stream whose reader (the client) falls this far behind stops reading from the worker.
HIGH_WATER_BYTES = 1 << 20
MAX_IDLE_PER_ORIGIN = 256
COPY_BODY_BELOW_BYTES = 64 * 1024


class UpstreamError(Exception):
    """The worker could not be reached, or broke off its answer."""


class UpstreamConnectError(UpstreamError):
    """No connection: nothing listens there, or the host is unreachable."""


class UpstreamTimeout(UpstreamError):
    """The worker did not accept the connection, or stayed silent, for longer than allowed."""


class UpstreamDisconnected(UpstreamError):
    """The connection broke (or the worker sent malformed HTTP) before the answer was complete."""


@dataclass(frozen=True)
class Origin:
    """Where a worker listens, parsed once: scheme, host, port and any base path of its URL."""

    host: str
    port: int
    tls: bool
    base_path: str
    host_header: bytes

    @classmethod
    def from_url(cls, url: str) -> Origin:
        parsed = URL(url)
        if parsed.scheme not in ("http", "https") or not parsed.host or parsed.port is None:
            raise ValueError(f"worker URL must look like http://host:port, got {url!r}")
        return cls(
            host=parsed.host,
            port=parsed.port,
            tls=parsed.scheme == "https",
            base_path=parsed.path.rstrip("/"),
            host_header=f"{parsed.host}:{parsed.port}".encode("idna"),
        )


class UpstreamResponse:
    """One answer from a worker: status and headers at once, the body as it arrives."""

    def __init__(self, connection: _Connection, read_timeout_s: float) -> None:
        self.status = 0
        # Lower-case names; a repeated header keeps its last value (the router reads only a few).
        self.headers: dict[str, str] = {}
        self.headers_done = False
        self.complete = False
        self.received_any = False
        self.delimited = False  # content-length or chunked: the end is in the message, not at EOF
        self._connection = connection
        self._read_timeout_s = read_timeout_s
        self._chunks: deque[bytes] = deque()
        self._buffered_bytes = 0
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._released = False
        self._reading_whole = False  # read() takes everything: no flow control

    # ---- fed by the connection ---------------------------------------------------------------

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered_bytes += len(data)
        if self._buffered_bytes > HIGH_WATER_BYTES and not self._reading_whole:
            self._connection.pause_reading()
        self._wake()

    def _finish(self) -> None:
        self.complete = True
        self._wake()

    def _fail(self, error: UpstreamError) -> None:
        if self._error is None and not self.complete:
            self._error = error
        self._wake()

    # ---- read by the router ------------------------------------------------------------------

    async def _wait(self) -> None:
        """Until the connection delivers something; raises what broke it or a silence timeout."""
        if self._error is not None:
            raise self._error
        loop = self._connection.loop
        waiter = self._waiter = loop.create_future()
        timer = loop.call_later(self._read_timeout_s, self._on_silence, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None
        if self._error is not None:
            raise self._error

    def _on_silence(self, waiter: asyncio.Future[None]) -> None:
        if not waiter.done():
            self._fail(UpstreamTimeout(f"worker silent for {self._read_timeout_s:g} s"))

    async def _wait_headers(self) -> None:
        while not self.headers_done:
            await self._wait()

    async def read(self) -> bytes:
        """The whole body."""
        self._reading_whole = True
        self._connection.resume_reading()
        while not self.complete:
            await self._wait()
        body = b"".join(self._chunks)
        self._chunks.clear()
        self._buffered_bytes = 0
        return body

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives; ends when the answer is complete."""
        while True:
            if self._chunks:
                data = b"".join(self._chunks) if len(self._chunks) > 1 else self._chunks[0]
                self._chunks.clear()
                if self._buffered_bytes > HIGH_WATER_BYTES:
                    self._connection.resume_reading()
                self._buffered_bytes = 0
                yield data
            elif self.complete:
                return
            else:
                await self._wait()

    def release(self) -> None:
        """Hand the connection back (answer read to the end) or close it (anything else). Idempotent."""
        if self._released:
            return
        self._released = True
        self._connection.done(self)


class _Connection(asyncio.Protocol):
    """One keep-alive connection to a worker; carries one request at a time."""

    def __init__(self, pool: UpstreamPool, origin: Origin, loop: asyncio.AbstractEventLoop) -> None:
        self.pool = pool
        self.origin = origin
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.response: UpstreamResponse | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._reading_paused = False
        self._keep_alive = False

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None:
            self.close()  # bytes nobody asked for: the connection is out of step
            return
        response.received_any = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            response._fail(UpstreamDisconnected(f"malformed HTTP from worker: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool._forget(self)
        response = self.response
        if response is None or response.complete:
            return
        if response.headers_done and not response.delimited:
            response._finish()  # the body ran to EOF by design
            return
        cause = f": {exc}" if exc else ""
        response._fail(UpstreamDisconnected(f"worker closed the connection{cause}"))

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        response = self.response
        assert response is not None
        key = name.decode("latin-1").lower()
        response.headers[key] = value.decode("latin-1")
        if key == "content-length" or (key == "transfer-encoding" and b"chunked" in value.lower()):
            response.delimited = True

    def on_headers_complete(self) -> None:
        response = self.response
        assert response is not None
        response.status = self._parser.get_status_code()
        response.headers_done = True
        response._wake()

    def on_body(self, body: bytes) -> None:
        assert self.response is not None
        self.response._feed(body)

    def on_message_complete(self) -> None:
        assert self.response is not None
        # Asked here: llhttp resets its flags once the message is done.
        self._keep_alive = self._parser.should_keep_alive()
        self.response._finish()

    # flow control, driven by the response
    def pause_reading(self) -> None:
        if not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._reading_paused and self.transport is not None and not self.closed:
            self._reading_paused = False
            self.transport.resume_reading()

    def send(self, head: bytes, body: bytes, read_timeout_s: float) -> UpstreamResponse:
        assert self.transport is not None
        self.response = UpstreamResponse(self, read_timeout_s)
        self._keep_alive = False
        if len(body) < COPY_BODY_BELOW_BYTES:
            self.transport.write(head + body)  # one send; copying a small body costs less than two
        else:
            self.transport.writelines((head, body))
        return self.response

    def done(self, response: UpstreamResponse) -> None:
        if response is not self.response:
            return
        self.response = None
        if response.complete and not self.closed and self._keep_alive:
            self.resume_reading()
            self.pool._put_back(self)
        else:
            self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.pool._forget(self)
            if self.transport is not None:
                self.transport.close()


class UpstreamPool:
    """Keep-alive connections to every worker, reused last-in first-out."""

    def __init__(self, connect_timeout_s: float, read_timeout_s: float) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self._idle: dict[Origin, list[_Connection]] = {}
        self._all: set[_Connection] = set()
        self._ssl: ssl.SSLContext | None = None

    async def request(self, origin: Origin, path: str, headers: bytes, body: bytes) -> UpstreamResponse:
        """POST `body` to `origin` + `path`; returns once the worker's headers are in.

        `headers` are complete header lines (`name: value\\r\\n` each) besides Host and
        Content-Length. A reused connection that breaks before any byte of the answer (the
        worker closed it while idle) is replaced by a fresh one once, transparently.
        """
        head = b"POST %s HTTP/1.1\r\nhost: %s\r\ncontent-length: %d\r\n%s\r\n" % (
            (origin.base_path + path).encode(),
            origin.host_header,
            len(body),
            headers,
        )
        connection = self._take_idle(origin)
        if connection is not None:
            response = connection.send(head, body, self.read_timeout_s)
            try:
                await response._wait_headers()
                return response
            except UpstreamDisconnected:
                response.release()
                if response.received_any:
                    raise
            except BaseException:
                response.release()
                raise
        connection = await self._connect(origin)
        response = connection.send(head, body, self.read_timeout_s)
        try:
            await response._wait_headers()
        except BaseException:
            response.release()
            raise
        return response

    def _take_idle(self, origin: Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        while idle:
            connection = idle.pop()
            if not connection.closed:
                return connection
        return None

    async def _connect(self, origin: Origin) -> _Connection:
        loop = asyncio.get_running_loop()
        ssl_context: ssl.SSLContext | None = None
        if origin.tls:
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            ssl_context = self._ssl
        try:
            _, connection = await asyncio.wait_for(
                loop.create_connection(
                    lambda: _Connection(self, origin, loop), origin.host, origin.port, ssl=ssl_context
                ),
                self.connect_timeout_s,
            )
        except asyncio.TimeoutError as exc:
            raise UpstreamTimeout(f"no connection within {self.connect_timeout_s:g} s") from exc
        except OSError as exc:
            raise UpstreamConnectError(f"cannot connect: {exc}") from exc
        self._all.add(connection)
        return connection

    def _put_back(self, connection: _Connection) -> None:
        idle = self._idle.setdefault(connection.origin, [])
        if len(idle) >= MAX_IDLE_PER_ORIGIN:
            connection.close()
        else:
            idle.append(connection)

    def drop(self, origin: Origin) -> None:
        """Close the idle connections to a worker that left the pool."""
        for connection in self._idle.pop(origin, []):
            connection.close()

    def _forget(self, connection: _Connection) -> None:
        self._all.discard(connection)

    async def close(self) -> None:
        for connection in list(self._all):
            connection.close()
        self._idle.clear()
