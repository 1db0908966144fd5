"""The router's HTTP/1.1 front (hearth.router.front) over real loopback sockets.

Well-behaved clients (aiohttp, httpx) for the common paths; raw bytes on a socket for the edges
a proxy meets: keep-alive, pipelining, Expect: 100-continue, chunked request bodies, HTTP/1.0,
oversized and malformed requests, a client that leaves mid-stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest

from hearth.router import front
from hearth.router.front import ClientGone, HttpServer, Request, Response, StreamWriter, json_response

pytestmark = pytest.mark.timeout(30)


class App:
    def __init__(self) -> None:
        self.server = HttpServer()
        self.port = 0
        self.stream_gate = asyncio.Event()
        self.stream_outcome: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.server.add_route("POST", "/echo", self.echo)
        self.server.add_route("GET", "/hello", self.hello)
        self.server.add_route("GET", "/stream", self.stream)
        self.server.add_route("GET", "/boom", self.boom)

    async def echo(self, request: Request) -> Response:
        return Response(200, request.body, "application/octet-stream", {"x-query": request.query_string})

    async def hello(self, request: Request) -> Response:
        return json_response({"hello": request.query.get("name", "")})

    async def stream(self, request: Request) -> StreamWriter:
        stream = await request.start_stream(200, {"content-type": "text/event-stream"})
        try:
            await stream.write(b"data: one\n\n")
            await self.stream_gate.wait()
            for _ in range(50):
                await stream.write(b"data: more\n\n")
                await asyncio.sleep(0.01)
            await stream.end()
            self.stream_outcome.set_result("ended")
        except ClientGone:
            self.stream_outcome.set_result("client gone")
        return stream

    async def boom(self, request: Request) -> Response:
        raise RuntimeError("handler bug")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture
async def app() -> AsyncIterator[App]:
    a = App()
    a.port = await a.server.start("127.0.0.1", 0)
    yield a
    await a.server.close()


async def raw_exchange(app: App, data: bytes, read_until_close: bool = True) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", app.port)
    writer.write(data)
    await writer.drain()
    try:
        if read_until_close:
            return await asyncio.wait_for(reader.read(), 5.0)
        return await asyncio.wait_for(reader.read(65536), 5.0)
    finally:
        writer.close()


async def test_routes_bodies_queries_and_json(app: App) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.post(app.url + "/echo?a=1", data=b"payload") as resp:
            assert resp.status == 200 and await resp.read() == b"payload"
            assert resp.headers["x-query"] == "a=1" and "date" in resp.headers
        async with http.get(app.url + "/hello", params={"name": "ada lovelace"}) as resp:
            assert await resp.json() == {"hello": "ada lovelace"}


async def test_unknown_path_is_404_and_wrong_method_is_405_as_openai_errors(app: App) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(app.url + "/nope") as resp:
            assert resp.status == 404 and (await resp.json())["error"]["type"] == "not_found_error"
        async with http.delete(app.url + "/echo") as resp:
            assert resp.status == 405 and "POST" in (await resp.json())["error"]["message"]


async def test_a_failing_handler_gives_500_and_the_connection_keeps_serving(app: App) -> None:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as http:
        async with http.get(app.url + "/boom") as resp:
            assert resp.status == 500 and (await resp.json())["error"]["type"] == "server_error"
        async with http.get(app.url + "/hello") as resp:
            assert resp.status == 200


async def test_keep_alive_and_pipelined_requests_are_answered_in_order(app: App) -> None:
    one = b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n\r\nfirst"
    two = b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 6\r\nconnection: close\r\n\r\nsecond"
    answer = await raw_exchange(app, one + two)
    assert answer.count(b"HTTP/1.1 200 OK") == 2
    assert answer.index(b"first") < answer.index(b"second")
    assert b"connection: close" in answer  # and the server closed: read() returned


async def test_a_long_pipeline_is_answered_whole_and_in_order(app: App) -> None:
    requests = [b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\n\r\n%03d" % i for i in range(40)]
    requests.append(b"GET /hello HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    answer = await raw_exchange(app, b"".join(requests))
    bodies = [part[:3] for part in answer.split(b"\r\n\r\n")[1:-1]]
    assert bodies == [b"%03d" % i for i in range(40)]


async def test_a_client_that_half_closes_after_its_request_still_gets_the_answer(app: App) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", app.port)
    writer.write(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 4\r\n\r\nbye!")
    writer.write_eof()
    answer = await asyncio.wait_for(reader.read(), 5.0)
    assert answer.startswith(b"HTTP/1.1 200 OK") and answer.endswith(b"bye!")
    writer.close()


async def test_chunked_request_body_is_decoded(app: App) -> None:
    data = (
        b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n"
        b"4\r\nabcd\r\n3\r\nefg\r\n0\r\n\r\n"
    )
    answer = await raw_exchange(app, data)
    assert answer.endswith(b"\r\n\r\nabcdefg")


async def test_expect_100_continue_gets_its_interim_answer(app: App) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", app.port)
    writer.write(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\nexpect: 100-continue\r\n\r\n")
    interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
    assert interim.startswith(b"HTTP/1.1 100 Continue")
    writer.write(b"ok")
    final = await asyncio.wait_for(reader.readuntil(b"ok"), 5.0)
    assert final.startswith(b"HTTP/1.1 200 OK")
    writer.close()


async def test_http_1_0_stream_is_unchunked_and_ends_with_the_connection(app: App) -> None:
    app.stream_gate.set()
    answer = await raw_exchange(app, b"GET /stream HTTP/1.0\r\n\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"transfer-encoding" not in head and body.startswith(b"data: one\n\ndata: more")
    assert await asyncio.wait_for(app.stream_outcome, 5.0) == "ended"


async def test_stream_is_chunked_and_flushed_chunk_by_chunk(app: App) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(app.url + "/stream") as resp:
            assert resp.headers["transfer-encoding"] == "chunked"
            # The handler waits on the gate after its first chunk: a buffering server would hang.
            first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5.0)
            assert first == b"data: one\n\n"
            app.stream_gate.set()
            rest = await resp.read()
    assert rest.count(b"data: more") == 50


async def test_a_client_that_leaves_mid_stream_is_seen_at_the_next_write(app: App) -> None:
    answer = await raw_exchange(app, b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n", read_until_close=False)
    assert b"data: one" in answer  # the connection is closed now, with the handler at its gate
    app.stream_gate.set()
    assert await asyncio.wait_for(app.stream_outcome, 5.0) == "client gone"


async def test_oversized_body_is_413_and_malformed_request_is_400(
    app: App, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(front, "MAX_BODY_BYTES", 10)
    answer = await raw_exchange(
        app, b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 20\r\n\r\n" + b"x" * 20
    )
    assert answer.startswith(b"HTTP/1.1 413 ")
    answer = await raw_exchange(app, b"NOT HTTP AT ALL\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 400 ") and b"malformed" in answer
    answer = await raw_exchange(app, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 400 ")


async def test_upgrade_requests_are_refused_not_served_without_their_body(app: App) -> None:
    data = b"POST /echo HTTP/1.1\r\nhost: x\r\nconnection: upgrade\r\nupgrade: h2c\r\ncontent-length: 2\r\n\r\nhi"
    answer = await raw_exchange(app, data)
    assert answer.startswith(b"HTTP/1.1 400 ") and b"upgrade" in answer


async def test_idle_and_stalled_connections_are_closed_but_busy_ones_are_not(
    app: App, monkeypatch: pytest.MonkeyPatch
) -> None:
    idle_reader, idle_writer = await asyncio.open_connection("127.0.0.1", app.port)
    idle_writer.write(b"GET /hello HTTP/1.1\r\nhost: x\r\n\r\n")
    await asyncio.wait_for(idle_reader.readuntil(b"}"), 5.0)
    stalled_reader, stalled_writer = await asyncio.open_connection("127.0.0.1", app.port)
    stalled_writer.write(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-len")  # and nothing more
    busy_reader, busy_writer = await asyncio.open_connection("127.0.0.1", app.port)
    busy_writer.write(b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n")
    await asyncio.wait_for(busy_reader.readuntil(b"data: one\n\n"), 5.0)  # its handler waits
    monkeypatch.setattr(front, "IDLE_TIMEOUT_S", 0.0)
    assert app.server.close_idle() == 2
    assert await asyncio.wait_for(idle_reader.read(), 5.0) == b""
    assert await asyncio.wait_for(stalled_reader.read(), 5.0) == b""
    app.stream_gate.set()
    assert await asyncio.wait_for(app.stream_outcome, 5.0) == "ended"
    for writer in (idle_writer, stalled_writer, busy_writer):
        writer.close()


async def test_a_content_length_past_the_limit_is_413_before_any_body(app: App) -> None:
    """`Content-Length: 100000000000` is refused from the header at once, not read up to the limit."""
    reader, writer = await asyncio.open_connection("127.0.0.1", app.port)
    try:
        writer.write(
            b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 100000000000\r\n\r\n"
        )  # no body sent
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 2.0)
        assert answer.startswith(b"HTTP/1.1 413 ") and b"larger than" in answer
    finally:
        writer.close()


@pytest.mark.parametrize("shape", ["one_header", "many_headers", "long_url", "dripped"])
async def test_headers_past_60_kib_are_431(app: App, shape: str) -> None:
    big = b"a" * (front.MAX_HEADER_BYTES + 10)
    if shape == "one_header":
        head = b"GET /hello HTTP/1.1\r\nhost: x\r\nx-big: " + big + b"\r\n\r\n"
    elif shape == "many_headers":
        head = (
            b"GET /hello HTTP/1.1\r\n"
            + b"".join(b"x-h%d: %s\r\n" % (i, b"v" * 100) for i in range(700))
            + b"\r\n"
        )
    else:
        head = b"GET /hello?q=" + big + b" HTTP/1.1\r\nhost: x\r\n\r\n"
    if shape != "dripped":
        answer = await raw_exchange(app, head)
    else:  # a header that never ends, in small pieces: cut once 60 KiB have come
        reader, writer = await asyncio.open_connection("127.0.0.1", app.port)
        try:
            writer.write(b"GET /hello HTTP/1.1\r\nx-big: ")
            for _ in range(16):  # 64 KiB, then wait (more would race the close into a reset)
                writer.write(b"b" * 4096)
                await writer.drain()
                await asyncio.sleep(0.01)
            answer = await asyncio.wait_for(reader.read(), 5.0)
        finally:
            writer.close()
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:100]
    # just under the limit is served
    ok = await raw_exchange(
        app, b"GET /hello HTTP/1.1\r\nhost: x\r\nconnection: close\r\nx-b: " + b"a" * 50000 + b"\r\n\r\n"
    )
    assert ok.startswith(b"HTTP/1.1 200 ")
