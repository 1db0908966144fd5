"""The router's keep-alive client (hearth.router.upstream) against scripted raw-socket servers."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from hearth.router.upstream import (
    Origin,
    UpstreamConnectError,
    UpstreamDisconnected,
    UpstreamPool,
    UpstreamTimeout,
)

pytestmark = pytest.mark.timeout(30)
HEADERS = b"content-type: application/json\r\n"
Reply = Callable[[asyncio.StreamWriter, bytes], Awaitable[bool]]  # returns False to close


def ok(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)


class ScriptedServer:
    """Answers each request with the next reply of its script; records connections and requests."""

    def __init__(self, script: list[Reply]) -> None:
        self.script = script
        self.connections = 0
        self.requests: list[bytes] = []
        self.closed_by_client = asyncio.Event()
        self.port = 0
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> Origin:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return Origin.from_url(f"http://127.0.0.1:{self.port}")

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while self.script:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                self.requests.append(head + await reader.readexactly(length))
                if not await self.script.pop(0)(writer, head):
                    break
            else:
                if await reader.read() == b"":
                    self.closed_by_client.set()
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed_by_client.set()
        finally:
            writer.close()

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()


def reply(data: bytes, keep_open: bool = True) -> Reply:
    async def send(writer: asyncio.StreamWriter, head: bytes) -> bool:
        writer.write(data)
        await writer.drain()
        return keep_open

    return send


@pytest.fixture
async def pool() -> AsyncIterator[UpstreamPool]:
    p = UpstreamPool(connect_timeout_s=2.0, read_timeout_s=0.5)
    yield p
    await p.close()


async def fetch(pool: UpstreamPool, origin: Origin, body: bytes = b"{}") -> tuple[int, bytes]:
    response = await pool.request(origin, "/v1/completions", HEADERS, body)
    try:
        return response.status, await response.read()
    finally:
        response.release()


async def test_requests_reuse_one_keep_alive_connection_and_carry_host_and_length(pool: UpstreamPool) -> None:
    server = ScriptedServer([reply(ok(b"one")), reply(ok(b"two")), reply(ok(b"three"))])
    origin = await server.start()
    answers = [await fetch(pool, origin, b'{"n": %d}' % i) for i in range(3)]
    assert answers == [(200, b"one"), (200, b"two"), (200, b"three")]
    assert server.connections == 1
    first = server.requests[0]
    assert first.startswith(b"POST /v1/completions HTTP/1.1\r\n")
    assert b"host: 127.0.0.1:%d\r\n" % server.port in first and first.endswith(b'\r\n\r\n{"n": 0}')
    await server.close()


async def test_a_connection_the_worker_closed_while_idle_is_replaced_transparently(
    pool: UpstreamPool,
) -> None:
    server = ScriptedServer([reply(ok(b"one"), keep_open=False), reply(ok(b"two"))])
    origin = await server.start()
    assert await fetch(pool, origin) == (200, b"one")
    await asyncio.sleep(0.05)  # the close may or may not have reached the pool yet: both must work
    assert await fetch(pool, origin) == (200, b"two")
    assert server.connections == 2
    await server.close()


async def test_a_reused_connection_that_breaks_before_any_answer_byte_is_retried_once(
    pool: UpstreamPool,
) -> None:
    server = ScriptedServer([reply(ok(b"one")), reply(b"", keep_open=False), reply(ok(b"two"))])
    origin = await server.start()
    assert await fetch(pool, origin) == (200, b"one")
    assert await fetch(pool, origin) == (200, b"two")  # the reused connection hung up unanswered
    assert server.connections == 2 and len(server.requests) == 3
    await server.close()


async def test_chunked_and_eof_delimited_bodies_are_read_whole(pool: UpstreamPool) -> None:
    chunked = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
    until_eof = b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of it"
    server = ScriptedServer([reply(chunked), reply(until_eof, keep_open=False)])
    origin = await server.start()
    assert await fetch(pool, origin) == (200, b"abcde")
    assert await fetch(pool, origin) == (200, b"all of it")
    await server.close()


async def test_headers_arrive_before_the_body_and_chunks_stream(pool: UpstreamPool) -> None:
    gate = asyncio.Event()

    async def slow_stream(writer: asyncio.StreamWriter, head: bytes) -> bool:
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        writer.write(b"6\r\nfirst\n\r\n")
        await writer.drain()
        await gate.wait()
        writer.write(b"7\r\nsecond\n\r\n0\r\n\r\n")
        await writer.drain()
        return True

    server = ScriptedServer([slow_stream])
    origin = await server.start()
    response = await pool.request(origin, "/v1/completions", HEADERS, b"{}")
    assert response.headers["content-type"] == "text/event-stream"
    chunks = response.chunks()
    assert await asyncio.wait_for(chunks.__anext__(), 5.0) == b"first\n"
    gate.set()
    assert [c async for c in chunks] == [b"second\n"]
    response.release()
    await server.close()


async def test_refused_connection_is_a_connect_error(pool: UpstreamPool) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        with pytest.raises(UpstreamConnectError):
            await pool.request(Origin.from_url(f"http://127.0.0.1:{port}"), "/x", HEADERS, b"")


async def test_a_silent_worker_times_out_before_and_after_its_headers(pool: UpstreamPool) -> None:
    async def silent(writer: asyncio.StreamWriter, head: bytes) -> bool:
        await asyncio.sleep(10)
        return False

    async def headers_then_silent(writer: asyncio.StreamWriter, head: bytes) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nhi\r\n")
        await writer.drain()
        await asyncio.sleep(10)
        return False

    server = ScriptedServer([silent])
    origin = await server.start()
    with pytest.raises(UpstreamTimeout):
        await pool.request(origin, "/x", HEADERS, b"")
    await server.close()
    server = ScriptedServer([headers_then_silent])
    origin = await server.start()
    response = await pool.request(origin, "/x", HEADERS, b"")
    with pytest.raises(UpstreamTimeout):
        async for _ in response.chunks():
            pass
    response.release()
    await server.close()


async def test_a_body_cut_short_is_an_error_and_the_connection_is_not_reused(pool: UpstreamPool) -> None:
    cut = b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly part"
    server = ScriptedServer([reply(cut, keep_open=False), reply(ok(b"fresh"))])
    origin = await server.start()
    response = await pool.request(origin, "/x", HEADERS, b"")
    with pytest.raises(UpstreamDisconnected):
        await response.read()
    response.release()
    assert await fetch(pool, origin) == (200, b"fresh")
    assert server.connections == 2
    await server.close()


async def test_releasing_an_unfinished_answer_closes_the_connection(pool: UpstreamPool) -> None:
    async def endless(writer: asyncio.StreamWriter, head: bytes) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nhi\r\n")
        await writer.drain()
        return True  # then wait for the next request, or for the client to hang up

    server = ScriptedServer([endless])
    origin = await server.start()
    response = await pool.request(origin, "/x", HEADERS, b"")
    response.release()  # the client left: the worker must see its connection close
    await asyncio.wait_for(server.closed_by_client.wait(), 5.0)
    await server.close()


def test_origin_parses_scheme_host_port_and_base_path() -> None:
    origin = Origin.from_url("https://gpu-7.internal:8443/serving")
    assert (origin.host, origin.port, origin.tls, origin.base_path) == (
        "gpu-7.internal",
        8443,
        True,
        "/serving",
    )
    assert Origin.from_url("http://10.0.0.1").port == 80
    with pytest.raises(ValueError):
        Origin.from_url("ftp://x:1")


async def test_dropping_a_worker_closes_its_idle_connections(pool: UpstreamPool) -> None:
    server = ScriptedServer([reply(ok(b"one"))])
    origin = await server.start()
    assert await fetch(pool, origin) == (200, b"one")
    assert not server.closed_by_client.is_set()
    pool.drop(origin)
    await asyncio.wait_for(server.closed_by_client.wait(), 5.0)
    await server.close()


async def test_bodies_larger_than_the_flow_control_window_arrive_whole(pool: UpstreamPool) -> None:
    big = bytes(range(256)) * (3 * 4096)  # 3 MiB, three times the high-water mark
    server = ScriptedServer([reply(ok(big)), reply(ok(big))])
    origin = await server.start()
    assert await fetch(pool, origin) == (200, big)
    response = await pool.request(origin, "/x", HEADERS, b"")
    received = b""
    async for chunk in response.chunks():
        await asyncio.sleep(0)  # a reader that lags: reading from the worker pauses and resumes
        received += chunk
    response.release()
    assert received == big
    await server.close()
