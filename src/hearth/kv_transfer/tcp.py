"""`--kv-transfer tcp`: KV pages between servers over one TCP connection per transfer.

The prefill server connects to the decode server's listener (bound where `--kv-transfer-host` says,
loopback by default). Frames are a 4-byte big-endian length and a msgspec (msgpack) header; page data
follows a `Batch` header as raw tensor bytes (page-major). Nothing is pickled, and a batch of many pages
is streamed with no per-page round trip. Every frame after the handshake carries a 16-byte tag (after
its header) that covers the header and the page bytes that follow it (`hearth.kv_transfer.auth`).

    sender (prefill)                          receiver (decode)
    Hello(transfer_id, nonce_s)        ─▶     (a 32-hex id and a 32-byte nonce, or the socket closes)
                                        ◀─    Challenge(nonce_r, layout, HMAC(secret, ids|nonces|layout))
    Auth(HMAC(secret, ids|nonces|what it announces),
         layout, num_tokens, prompt_hash,
         FP8 scales if the pages are FP8) ─▶   checks the MAC and the layout, waits (up to the timeout)
                                               for the decode request to open the transfer
            -- from here each frame is tagged under the direction's HKDF(secret, id, nonces) key --
                                        ◀─    Want(first_page, num_pages) | Want(0, 0, error)
    Batch(transfer_id, ...) + bytes ... ─▶    each batch: its tag, then written under the lock, only
    Done(transfer_id)                  ─▶     if the transfer is still open (else dropped and counted)
                                        ◀─    Ack(ok)

Bytes are copied in user space only where they must be converted: the sender `sendmsg`s the pool's own
page runs, and a receiver whose pool has the wire's dtype `recvmsg_into`s them straight into its pages
(a close cuts that receive and waits for it); a batch whose tag fails there fails the transfer, and its
pages are recomputed before any request reads them. Other dtypes (and FP8 scales) are converted at the
receiver through `hearth.kv.convert`, with its own scales, after the tag verified.

Both sides prove they hold the deployment's secret (a challenge each way, so neither a stray sender nor
a stray listener gets KV). Nothing a connection says is stored or logged before it authenticated: the
listener takes at most `MAX_CONNECTIONS` at once, a handshake must finish within `HANDSHAKE_TIMEOUT_S`
in total (a slow drip is cut), refusals are counted and logged once per cause and interval, and only an
authenticated sender can fail a transfer (a refused handshake leaves the real one waiting for its own
sender). Wanting pages from `first_page` on is what makes the decode server's own prefix-cache hits
shrink the transfer.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import socket
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

import msgspec
import torch

from hearth.kv_transfer.auth import (
    NONCE_BYTES,
    TAG_BYTES,
    FrameAuthError,
    FrameMAC,
    handshake_mac,
    is_transfer_id,
    session_keys,
)
from hearth.kv_transfer.base import (
    WIRE_DTYPES,
    KVTransport,
    PageSink,
    ReceiveSpec,
    Scales,
    SendSpec,
    TransferEvent,
    WireLayout,
    dtype_name,
)

logger = logging.getLogger("hearth.kv_transfer")

PROTOCOL_VERSION = 2  # 2: tagged frames (1 had unkeyed page checksums and a MAC over the nonces only)
_LENGTH = struct.Struct("!I")
MAX_HEADER_BYTES = 64 << 10  # an authenticated frame's header (a Batch is ~100 bytes)
HELLO_BYTES = 256  # before authentication a frame is small: Hello is ~90 bytes
MAX_CONNECTIONS = 64  # connections served at once; more are closed at accept (counted)
HANDSHAKE_TIMEOUT_S = 10.0  # Hello to authenticated Auth, in total (at most the transfer timeout)
REFUSAL_LOG_INTERVAL_S = 60.0  # one warning per cause per interval, with the count since the last
BATCH_BYTES = 8 << 20  # pages per batch: about this many bytes (at least one page)
# Kernel socket buffers for page streams. Linux's autotuned default starts small on a fresh connection,
# and loopback then runs at ~0.8 GB/s with nothing else to do (scripts/bench_kv_transfer.py); 4 MiB each
# way (the default net.core.[rw]mem_max caps what a process may ask) about doubles that. Set before
# connect/listen so the window scale the handshake negotiates can use it.
SOCKET_BUFFER_BYTES = 4 << 20
_MAX_IOVECS = 512  # buffers per sendmsg call (Linux's IOV_MAX is 1024)
_FREE_BUFFERS = 4  # reusable batch buffers kept per transport (one per concurrent connection in use)
_CLOSED_MEMORY = 65536  # closed/failed transfer ids remembered, so late senders are answered at once


class Hello(msgspec.Struct, tag=True):
    version: int
    transfer_id: str
    nonce: bytes


class Challenge(msgspec.Struct, tag=True):
    nonce: bytes
    mac: bytes
    layout: WireLayout


class Auth(msgspec.Struct, tag=True):
    mac: bytes
    layout: WireLayout
    num_tokens: int
    prompt_hash: int
    # An FP8 sender's scales, K then V, each `[num_layers, num_kv_heads]` row-major (float32 values).
    scales: list[float] | None = None


class Want(msgspec.Struct, tag=True):
    first_page: int
    num_pages: int
    error: str | None = None
    # Transports that move page bytes off this socket (mooncake): where the sender writes them.
    remote: str | None = None
    remote_addr: int = 0


class Batch(msgspec.Struct, tag=True):
    transfer_id: str
    first_page: int
    num_pages: int
    dtype: str
    offset: int = 0  # byte offset of this batch in the transfer's payload (off-socket transports)


class Done(msgspec.Struct, tag=True):
    transfer_id: str


class Ack(msgspec.Struct, tag=True):
    ok: bool
    error: str | None = None


Message = Hello | Challenge | Auth | Want | Batch | Done | Ack
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


class TransferError(RuntimeError):
    pass


class _Refused(Exception):
    """A connection that did not authenticate: closed, counted and logged by cause, nothing else."""


def _recv_exact(sock: socket.socket, buffer: bytearray | memoryview, deadline: float | None = None) -> None:
    view = memoryview(buffer)
    while view:
        if deadline is not None:  # a total deadline: a sender dripping a byte at a time is cut too
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _Refused("the handshake did not finish in time")
            sock.settimeout(remaining)
        count = sock.recv_into(view)
        if count == 0:
            raise TransferError("the peer closed the connection mid-transfer")
        view = view[count:]


def _tune(sock: socket.socket, buffer_bytes: int) -> None:
    if buffer_bytes <= 0:  # 0: the kernel's autotuned default (scripts/bench_kv_transfer.py's baseline)
        return
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, buffer_bytes)
        except OSError:  # some platforms cap or refuse it: the default still works, slower
            pass


class _BufferPool:
    """Batch buffers reused across batches and transfers: a fresh 8 MiB buffer per batch costs its
    page faults (and zeroing) every time, which measured as much as the copy itself."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[bytearray] = []

    def take(self, size: int) -> bytearray:
        with self._lock:
            for index, buffer in enumerate(self._free):
                if len(buffer) >= size:
                    return self._free.pop(index)
        return bytearray(max(size, BATCH_BYTES))

    def give(self, buffer: bytearray) -> None:
        with self._lock:
            if len(self._free) < _FREE_BUFFERS:
                self._free.append(buffer)


def _recv_exact_parts(sock: socket.socket, views: list[memoryview]) -> None:
    """Fill every buffer of `views` in order from the socket (`recvmsg_into`: one call, many buffers)."""
    views = list(views)
    first = 0
    while first < len(views):
        count = sock.recvmsg_into(views[first : first + _MAX_IOVECS])[0]
        if count == 0:
            raise TransferError("the peer closed the connection mid-transfer")
        while first < len(views) and count >= len(views[first]):
            count -= len(views[first])
            first += 1
        if count:
            views[first] = views[first][count:]


def _sendall_parts(sock: socket.socket, parts: list[bytes | memoryview]) -> None:
    """`sendall` of several buffers with `sendmsg` (no concatenation copy of the page bytes)."""
    views = [memoryview(part).cast("B") for part in parts]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if views and sent:
            views[0] = views[0][sent:]


def send_message(sock: socket.socket, message: Message) -> None:
    """An untagged frame: the handshake's (each carries its own MAC)."""
    data = _encoder.encode(message)
    sock.sendall(_LENGTH.pack(len(data)) + data)


def _recv_header(sock: socket.socket, limit: int, deadline: float | None) -> bytearray:
    length = bytearray(_LENGTH.size)
    _recv_exact(sock, length, deadline)
    (size,) = _LENGTH.unpack(length)
    if size > limit:
        raise TransferError(f"a {size}-byte header is too large (at most {limit} here)")
    data = bytearray(size)
    _recv_exact(sock, data, deadline)
    return data


def recv_message(
    sock: socket.socket, limit: int = MAX_HEADER_BYTES, deadline: float | None = None
) -> Message:
    return _decoder.decode(_recv_header(sock, limit, deadline))


def send_tagged(
    sock: socket.socket, frames: FrameMAC, message: Message, payload: Sequence[memoryview] = ()
) -> None:
    """A frame after the handshake: header, its tag (over the header and `payload`), then `payload`."""
    data = _encoder.encode(message)
    first = _LENGTH.pack(len(data)) + data + frames.tag(data, payload)
    if not payload:
        sock.sendall(first)
        return
    for start in range(0, len(payload), _MAX_IOVECS):  # header and pages in few calls, no concatenation
        parts = list(payload[start : start + _MAX_IOVECS])
        _sendall_parts(sock, [first, *parts] if start == 0 else parts)


def recv_tagged(sock: socket.socket) -> tuple[Message, bytes, bytes]:
    """A tagged frame's header as (message, header bytes, tag): the caller verifies the tag, after the
    payload that follows a `Batch` arrived."""
    data = bytes(_recv_header(sock, MAX_HEADER_BYTES, None))
    tag = bytearray(TAG_BYTES)
    _recv_exact(sock, tag)
    return _decoder.decode(data), data, bytes(tag)


def recv_verified(sock: socket.socket, frames: FrameMAC, kind: type[Message]) -> Message:
    message, data, tag = recv_tagged(sock)
    frames.verify(tag, data)
    return _expect(message, kind)


def auth_mac(
    secret: bytes, transfer_id: str, sender_nonce: bytes, receiver_nonce: bytes, auth: Auth
) -> bytes:
    body = _encoder.encode(msgspec.structs.replace(auth, mac=b""))
    return handshake_mac(secret, b"sender", transfer_id, sender_nonce, receiver_nonce, body)


def challenge_mac(
    secret: bytes, transfer_id: str, sender_nonce: bytes, receiver_nonce: bytes, layout: WireLayout
) -> bytes:
    return handshake_mac(
        secret, b"receiver", transfer_id, sender_nonce, receiver_nonce, _encoder.encode(layout)
    )


class _RefusalLog:
    """Refused connections: counted by cause, one warning per cause per interval (a flood of bad
    handshakes costs a few lines of log, not one per connection)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[str, tuple[int, float]] = {}  # cause -> (count since last logged, when logged)

    def note(self, cause: str, peer: str) -> None:
        now = time.monotonic()
        with self._lock:
            count, logged = self._pending.get(cause, (0, -REFUSAL_LOG_INTERVAL_S))
            count += 1
            if now - logged < REFUSAL_LOG_INTERVAL_S:
                self._pending[cause] = (count, logged)
                return
            self._pending[cause] = (0, now)
        # The cause is ours; the peer is an address: nothing the peer sent reaches the log.
        logger.warning("KV listener refused %d connection(s) (last from %s): %s", count, peer, cause)


def _expect(message: Message, kind: type[Message]) -> Message:
    if not isinstance(message, kind):
        raise TransferError(f"protocol error: expected {kind.__name__}, got {type(message).__name__}")
    return message


def encode_scales(scales: Scales | None) -> list[float] | None:
    if scales is None:
        return None
    return torch.stack(scales).float().flatten().tolist()


def decode_scales(values: list[float] | None, layout: WireLayout) -> Scales | None:
    if values is None:
        return None
    if len(values) != 2 * layout.num_layers * layout.num_kv_heads:
        raise TransferError(f"{len(values)} FP8 scales sent, this layout takes 2 x layers x KV heads")
    both = torch.tensor(values, dtype=torch.float32).view(2, layout.num_layers, layout.num_kv_heads)
    if not bool(torch.isfinite(both).all()) or not bool((both > 0).all()):
        raise TransferError("the sender's FP8 scales must be finite and > 0")
    return both[0], both[1]


def _peer(address: object) -> str:
    if isinstance(address, tuple) and len(address) >= 2:
        return f"{address[0]}:{address[1]}"
    return "an unknown address"


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    address = endpoint.removeprefix("tcp://")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"not a tcp endpoint: {endpoint!r} (expected tcp://HOST:PORT)")
    return host.strip("[]"), int(port)


class TCPTransport(KVTransport):
    name = "tcp"

    def __init__(self, layout: WireLayout, secret: bytes, timeout_s: float, sink: PageSink) -> None:
        super().__init__(layout, secret, timeout_s, sink)
        self.batch_bytes = BATCH_BYTES
        self.socket_buffer_bytes = SOCKET_BUFFER_BYTES
        self.zero_copy_send = True  # False: gather into a staging buffer first (the bench's A/B)
        self.direct_receive = True  # False: receive into a buffer, then copy into the pool (the A/B)
        self._writing: dict[str, socket.socket] = {}  # transfers whose bytes are being received into the pool
        self._buffers = _BufferPool()
        self._local = threading.local()  # each connection thread's reused batch buffer
        self._cond = threading.Condition()  # guards everything below and every write into the pool
        self._open: dict[str, ReceiveSpec] = {}
        self._claimed: set[str] = set()  # open transfers a sender is connected for
        self._closed: OrderedDict[str, None] = OrderedDict()
        self._failed_early: OrderedDict[str, str] = OrderedDict()  # failed before the decode side opened it
        self._events: list[TransferEvent] = []
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._refusals = _RefusalLog()
        self._server: socket.socket | None = None
        self._stopping = False

    # ---- the decode side ------------------------------------------------------------------------

    def listen(self, host: str, port: int) -> str:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        server = socket.socket(family, socket.SOCK_STREAM)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        _tune(server, self.socket_buffer_bytes)  # accepted connections inherit the buffer sizes
        server.bind((host, port))
        server.listen(256)
        self._server = server
        bound_port = server.getsockname()[1]
        threading.Thread(target=self._accept_loop, name="hearth-kv-accept", daemon=True).start()
        shown = f"[{host}]" if ":" in host else host
        return f"tcp://{shown}:{bound_port}"

    def open_receive(self, spec: ReceiveSpec) -> None:
        with self._cond:
            reason = self._failed_early.pop(spec.transfer_id, None)
            if reason is not None:
                self._push(TransferEvent(spec.transfer_id, "received", False, reason))
                return
            self._open[spec.transfer_id] = spec
            self._cond.notify_all()

    def close_receive(self, transfer_id: str) -> None:
        with self._cond:  # a copy into the pool holds this lock: when we have it, none is under way
            self._open.pop(transfer_id, None)
            self._remember(self._closed, transfer_id, None)
            self._cond.notify_all()
            sock = self._writing.get(transfer_id)
            if sock is not None:
                # Bytes are being received straight into its pages: cut the connection (the receive
                # returns at once) and wait until that thread has left the pool.
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                self._cond.wait_for(lambda: transfer_id not in self._writing)

    def _accept_loop(self) -> None:
        server = self._server
        assert server is not None
        while not self._stopping:
            try:
                sock, address = server.accept()
            except OSError:
                return  # closed
            if not self._slots.acquire(blocking=False):
                # At the cap: closed at once (the sender's transfer fails and its decode side recomputes)
                # rather than one more thread per connection.
                with self._cond:
                    self.counters.connections_refused += 1
                self._refusals.note(f"more than {MAX_CONNECTIONS} connections at once", _peer(address))
                sock.close()
                continue
            try:
                threading.Thread(
                    target=self._serve, args=(sock, _peer(address)), name="hearth-kv-recv", daemon=True
                ).start()
            except RuntimeError:  # no thread to be had
                self._slots.release()
                sock.close()

    def _handshake(self, sock: socket.socket) -> tuple[str, Auth, FrameMAC, FrameMAC]:
        """The sender's transfer id, its Auth and the frame MACs (received, sent), once it proved it holds
        the secret; `_Refused` before that. Nothing it sent is kept or logged until then."""
        deadline = time.monotonic() + min(HANDSHAKE_TIMEOUT_S, self.timeout_s)
        try:
            hello = recv_message(sock, HELLO_BYTES, deadline)
        except (TransferError, msgspec.DecodeError) as exc:
            raise _Refused("not a KV transfer Hello") from exc
        if not isinstance(hello, Hello) or hello.version != PROTOCOL_VERSION:
            raise _Refused(f"not a KV transfer Hello of protocol version {PROTOCOL_VERSION}")
        if not is_transfer_id(hello.transfer_id) or len(hello.nonce) != NONCE_BYTES:
            raise _Refused("a malformed transfer id or nonce")
        transfer_id = hello.transfer_id
        nonce = secrets.token_bytes(NONCE_BYTES)
        send_message(
            sock,
            Challenge(
                nonce, challenge_mac(self.secret, transfer_id, hello.nonce, nonce, self.layout), self.layout
            ),
        )
        # An FP8 sender's scales make Auth the one larger handshake frame: bounded by this layout.
        limit = 1024 + 24 * self.layout.num_layers * self.layout.num_kv_heads
        try:
            auth = recv_message(sock, limit, deadline)
        except (TransferError, msgspec.DecodeError) as exc:
            raise _Refused("no valid Auth") from exc
        if not isinstance(auth, Auth) or not hmac.compare_digest(
            auth.mac, auth_mac(self.secret, transfer_id, hello.nonce, nonce, auth)
        ):
            # Told (so a misconfigured deployment sees why), but untagged and without touching the
            # transfer this connection named: only its authenticated sender may fail it.
            send_message(
                sock, Want(0, 0, "refused: the sender did not present this deployment's KV transfer secret")
            )
            raise _Refused("a sender without this deployment's KV transfer secret")
        sock.settimeout(self.timeout_s)
        sender_key, receiver_key = session_keys(self.secret, transfer_id, hello.nonce, nonce)
        return transfer_id, auth, FrameMAC(sender_key), FrameMAC(receiver_key)

    def _serve(self, sock: socket.socket, peer: str) -> None:
        transfer_id = None  # set once the sender authenticated
        claimed = False
        try:
            with sock:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                try:
                    transfer_id, auth, frames_in, frames_out = self._handshake(sock)
                except (_Refused, OSError) as exc:
                    with self._cond:
                        self.counters.handshakes_refused += 1
                    cause = str(exc) if isinstance(exc, _Refused) else "the handshake broke off or timed out"
                    self._refusals.note(cause, peer)
                    return
                mismatch = self.layout.mismatch(auth.layout)
                if mismatch:
                    logger.error("KV transfer %s refused: %s", transfer_id, mismatch)
                    send_tagged(sock, frames_out, Want(0, 0, mismatch))
                    self._fail(transfer_id, mismatch)
                    return
                spec = self._claim(transfer_id)
                if spec is None:  # closed, not needed, or never opened in time: nothing to send
                    send_tagged(sock, frames_out, Want(0, 0))
                    return
                claimed = True
                if auth.prompt_hash != spec.prompt_hash or auth.num_tokens < spec.end_token:
                    why = (
                        "the prefill side computed another prompt"
                        if auth.prompt_hash != spec.prompt_hash
                        else f"the prefill side holds {auth.num_tokens} tokens, {spec.end_token} are needed"
                    )
                    send_tagged(sock, frames_out, Want(0, 0, why))
                    self._fail(transfer_id, why)
                    return
                payload = self._open_payload(spec, auth.layout)
                try:
                    want = Want(spec.first_page, len(spec.page_ids))
                    send_tagged(sock, frames_out, self._want_extras(want, payload))
                    scales = decode_scales(auth.scales, self.layout)
                    self._receive_pages(sock, spec, payload, scales, frames_in, frames_out)
                finally:
                    self._close_payload(payload)
        except FrameAuthError as exc:
            with self._cond:
                self.counters.frames_refused += 1
            if transfer_id is not None:
                logger.warning("KV transfer %s: %s; its pages are recomputed", transfer_id, exc)
                self._fail(transfer_id, f"transfer refused: {exc}")
        except (OSError, TransferError, msgspec.DecodeError, ValueError) as exc:
            if transfer_id is not None:
                self._fail(transfer_id, f"transfer broken: {exc}")
        except Exception as exc:  # a bug here must still end the transfer (its request recomputes)
            logger.exception("KV transfer %s: receiving failed", transfer_id)
            if transfer_id is not None:
                self._fail(transfer_id, f"receiving failed: {type(exc).__name__}: {exc}")
        finally:
            self._slots.release()
            buffer = getattr(self._local, "buffer", None)
            if buffer is not None:
                self._local.buffer = None
                self._buffers.give(buffer)
            if claimed:
                with self._cond:
                    self._claimed.discard(transfer_id)

    def _claim(self, transfer_id: str) -> ReceiveSpec | None:
        """The open transfer this sender serves, waiting for the decode request to open it."""
        with self._cond:
            opened = self._cond.wait_for(
                lambda: transfer_id in self._open or transfer_id in self._closed or self._stopping,
                self.timeout_s,
            )
            spec = self._open.get(transfer_id) if opened else None
            if spec is None or transfer_id in self._claimed:
                return None
            self._claimed.add(transfer_id)
            return spec

    # ---- how page bytes travel (here: on the socket, after each Batch header) ------------------------

    def _open_payload(self, spec: ReceiveSpec, sender: WireLayout) -> object:
        return None

    def _want_extras(self, want: Want, payload: object) -> Want:
        return want

    def _recv_payload(self, sock: socket.socket, payload: object, batch: Batch, size: int) -> memoryview:
        """The batch's bytes; valid until the next call for this connection (the buffer is reused)."""
        buffer = getattr(self._local, "buffer", None)
        if buffer is None or len(buffer) < size:
            if buffer is not None:
                self._buffers.give(buffer)
            buffer = self._local.buffer = self._buffers.take(size)
        view = memoryview(buffer)[:size]
        _recv_exact(sock, view)
        return view

    def _close_payload(self, payload: object) -> None:
        pass

    def _send_payload(self, sock: socket.socket, want: Want, raw: memoryview, offset: int) -> None:
        """Off-socket transports move `raw` here; on TCP it follows its Batch header."""

    def _receive_pages(
        self,
        sock: socket.socket,
        spec: ReceiveSpec,
        payload: object,
        src_scales: Scales | None,
        frames_in: FrameMAC,
        frames_out: FrameMAC,
    ) -> None:
        layout = self.layout
        end_page = spec.first_page + len(spec.page_ids)
        next_page = spec.first_page
        while next_page < end_page:
            batch, header, tag = recv_tagged(sock)
            batch = _expect(batch, Batch)
            assert isinstance(batch, Batch)
            dtype = WIRE_DTYPES.get(batch.dtype)
            if dtype is None:
                raise TransferError(f"pages in dtype {batch.dtype!r} cannot be received here")
            if (dtype == torch.float8_e4m3fn) != (src_scales is not None):
                raise TransferError("FP8 pages come with the sender's scales, and only FP8 pages do")
            if (
                batch.first_page != next_page
                or batch.num_pages < 1
                or batch.first_page + batch.num_pages > end_page
            ):
                raise TransferError(f"batch of pages {batch.first_page}+{batch.num_pages} out of order")
            page_bytes = layout.page_bytes(dtype)
            offset = batch.first_page - spec.first_page
            page_ids = spec.page_ids[offset : offset + batch.num_pages]
            page_runs = getattr(self.sink, "page_runs", None)
            runs = (
                page_runs(page_ids, dtype)
                if page_runs is not None and payload is None and src_scales is None and self.direct_receive
                else None
            )
            if runs is not None:
                self._receive_into_pool(sock, spec, batch, runs)
                frames_in.verify(tag, header, runs)  # a failure fails the load: the pages are recomputed
            else:
                view = self._recv_payload(sock, payload, batch, page_bytes * batch.num_pages)
                frames_in.verify(tag, header, (view,))
                data = torch.frombuffer(view, dtype=dtype).view(batch.num_pages, *layout.page_shape())
                with self._cond:
                    # The transfer id is checked on every write: a closed transfer's pages may already be
                    # another request's, so its late pages are dropped, never written.
                    if batch.transfer_id != spec.transfer_id or self._open.get(spec.transfer_id) is not spec:
                        self.counters.late_writes_dropped += batch.num_pages
                        raise TransferError("the transfer was closed; late pages dropped")
                    self.sink(page_ids, data, src_scales)
            with self._cond:
                self.counters.pages_received += batch.num_pages
                self.counters.bytes_received += page_bytes * batch.num_pages
            next_page += batch.num_pages
        recv_verified(sock, frames_in, Done)
        with self._cond:
            ok = self._open.get(spec.transfer_id) is spec
            if ok:
                del self._open[spec.transfer_id]
                self._remember(self._closed, spec.transfer_id, None)
                self._push(TransferEvent(spec.transfer_id, "received", True, num_pages=len(spec.page_ids)))
        send_tagged(sock, frames_out, Ack(ok, None if ok else "the transfer was closed"))

    def _receive_into_pool(
        self, sock: socket.socket, spec: ReceiveSpec, batch: Batch, runs: list[memoryview]
    ) -> None:
        """The batch's bytes straight into the pool's pages (`recvmsg_into` over their runs): no buffer,
        no copy. The transfer is registered as writing while the bytes land; `close_receive` cuts the
        socket and waits for this to end, so no byte lands after it returns. The caller verifies the
        batch's tag on the pool's bytes afterwards: a mismatch fails the transfer (its pages are
        recomputed, and they were never visible to a request, which waits for the load to end)."""
        with self._cond:
            if batch.transfer_id != spec.transfer_id or self._open.get(spec.transfer_id) is not spec:
                self.counters.late_writes_dropped += batch.num_pages
                raise TransferError("the transfer was closed; late pages dropped")
            self._writing[spec.transfer_id] = sock
        try:
            _recv_exact_parts(sock, runs)
        finally:
            with self._cond:
                del self._writing[spec.transfer_id]
                self._cond.notify_all()
                closed = self._open.get(spec.transfer_id) is not spec
        if closed:
            raise TransferError("the transfer was closed mid-batch")

    def _fail(self, transfer_id: str, reason: str) -> None:
        with self._cond:
            if self._open.pop(transfer_id, None) is not None:
                self._remember(self._closed, transfer_id, None)
                self._push(TransferEvent(transfer_id, "received", False, reason))
            elif transfer_id not in self._closed:
                self._remember(self._failed_early, transfer_id, reason)

    # ---- the prefill side -----------------------------------------------------------------------

    def send(self, spec: SendSpec) -> None:
        threading.Thread(target=self._send, args=(spec,), name="hearth-kv-send", daemon=True).start()

    def _send(self, spec: SendSpec) -> None:
        ok, detail, num_pages = False, "", 0
        try:
            host, port = parse_endpoint(spec.endpoint)
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                _tune(sock, self.socket_buffer_bytes)
                sock.settimeout(self.timeout_s)
                sock.connect((host, port))
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                nonce = secrets.token_bytes(NONCE_BYTES)
                send_message(sock, Hello(PROTOCOL_VERSION, spec.transfer_id, nonce))
                challenge = _expect(recv_message(sock), Challenge)
                assert isinstance(challenge, Challenge)
                # Auth goes out before our verdict on the receiver, so a wrong secret is reported on
                # both sides (the receiver counts and logs the refusal).
                layout = (
                    spec.layout or self.layout
                )  # a part of this pool's heads, for a receiver of another TP size
                auth = Auth(b"", layout, spec.num_tokens, spec.prompt_hash, encode_scales(spec.source.scales))
                auth.mac = auth_mac(self.secret, spec.transfer_id, nonce, challenge.nonce, auth)
                send_message(sock, auth)
                expected = challenge_mac(
                    self.secret, spec.transfer_id, nonce, challenge.nonce, challenge.layout
                )
                if not hmac.compare_digest(challenge.mac, expected):
                    raise TransferError("the decode server did not prove it holds this deployment's secret")
                mismatch = layout.mismatch(challenge.layout)
                if mismatch:
                    raise TransferError(mismatch)
                sender_key, receiver_key = session_keys(self.secret, spec.transfer_id, nonce, challenge.nonce)
                frames_out, frames_in = FrameMAC(sender_key), FrameMAC(receiver_key)
                want = recv_verified(sock, frames_in, Want)
                assert isinstance(want, Want)
                if want.error:
                    raise TransferError(want.error)
                num_pages = self._send_pages(sock, spec, want, frames_out)
                if num_pages:
                    ack = recv_verified(sock, frames_in, Ack)
                    assert isinstance(ack, Ack)
                    ok, detail = ack.ok, ack.error or ""
                else:
                    ok, detail = True, "nothing wanted"
        except (OSError, TransferError, msgspec.DecodeError, ValueError) as exc:
            detail = str(exc) or type(exc).__name__
            logger.warning("KV transfer %s to %s failed: %s", spec.transfer_id, spec.endpoint, detail)
        except Exception as exc:  # a bug here must still answer the send: the pages it holds are released
            detail = f"sending failed: {type(exc).__name__}: {exc}"
            logger.exception("KV transfer %s to %s: sending failed", spec.transfer_id, spec.endpoint)
        with self._cond:
            self._push(TransferEvent(spec.transfer_id, "sent", ok, detail, num_pages if ok else 0))

    def _send_pages(self, sock: socket.socket, spec: SendSpec, want: Want, frames: FrameMAC) -> int:
        if want.num_pages == 0:
            return 0
        end = want.first_page + want.num_pages
        if want.first_page < 0 or end > spec.source.num_pages:
            raise TransferError(f"pages {want.first_page}..{end} wanted, {spec.source.num_pages} held")
        layout = spec.layout or self.layout
        page_bytes = layout.page_bytes(spec.source.dtype)
        per_batch = max(1, self.batch_bytes // page_bytes)
        page_runs = getattr(spec.source, "page_runs", None)
        if want.remote is None and self.zero_copy_send and page_runs is not None:
            # The kernel copies straight from the pool's pages (held until the send ends): no gather copy.
            first = want.first_page
            while first < end:
                count = min(per_batch, end - first)
                runs = page_runs(first, count)  # count pages x their contiguous runs, in wire order
                batch = Batch(spec.transfer_id, first, count, dtype_name(spec.source.dtype))
                send_tagged(sock, frames, batch, runs)
                with self._cond:
                    self.counters.pages_sent += count
                    self.counters.bytes_sent += count * page_bytes
                first += count
            send_tagged(sock, frames, Done(spec.transfer_id))
            return want.num_pages
        staging = self._buffers.take(per_batch * page_bytes)  # reused: no page faults per batch
        try:
            offset = 0
            first = want.first_page
            while first < end:
                count = min(per_batch, end - first)
                raw = memoryview(staging)[: count * page_bytes]
                out = torch.frombuffer(raw, dtype=spec.source.dtype).view(count, *layout.page_shape())
                spec.source.read_into(first, count, out)
                self._send_payload(sock, want, raw, offset)  # off-socket bytes land before their header
                batch = Batch(spec.transfer_id, first, count, dtype_name(spec.source.dtype), offset)
                if want.remote is None:  # header and pages in one call (no concatenation copy)
                    send_tagged(sock, frames, batch, (raw,))
                else:  # the tag covers the bytes the receiver finds in its staging buffer
                    data = _encoder.encode(batch)
                    sock.sendall(_LENGTH.pack(len(data)) + data + frames.tag(data, (raw,)))
                offset += len(raw)
                with self._cond:
                    self.counters.pages_sent += count
                    self.counters.bytes_sent += len(raw)
                first += count
        finally:
            self._buffers.give(staging)
        send_tagged(sock, frames, Done(spec.transfer_id))
        return want.num_pages

    # ---- both -----------------------------------------------------------------------------------

    def _push(self, event: TransferEvent) -> None:
        """With the lock held."""
        self._events.append(event)
        key = f"{event.kind}_{'ok' if event.ok else 'failed'}"
        self.counters.events[key] = self.counters.events.get(key, 0) + 1
        self.waker.wake()

    @staticmethod
    def _remember(memory: OrderedDict, key: str, value: object) -> None:  # type: ignore[type-arg]
        memory[key] = value
        memory.move_to_end(key)
        while len(memory) > _CLOSED_MEMORY:
            memory.popitem(last=False)

    def events(self) -> list[TransferEvent]:
        self.waker.drain()
        with self._cond:
            events, self._events = self._events, []
        return events

    def close(self) -> None:
        with self._cond:
            self._stopping = True
            self._open.clear()
            self._cond.notify_all()
        if self._server is not None:
            self._server.close()
        super().close()
