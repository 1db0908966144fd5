"""`--kv-transfer tcp`: KV pages between servers over one TCP connection per transfer.

The prefill server connects to the decode server's listener (bound where `--kv-transfer-host` says,
loopback by default). Frames are a 4-byte big-endian length and a msgspec (msgpack) header; page data
follows a `Batch` header as raw tensor bytes (page-major, so each page's bytes are contiguous and carry
an xxh3 checksum). Nothing is pickled, and a batch of many pages is streamed with no per-page round trip.

    sender (prefill)                          receiver (decode)
    Hello(transfer_id, nonce_s)        ─▶
                                        ◀─    Challenge(nonce_r, HMAC(secret, r|nonce_s|nonce_r), layout)
    Auth(HMAC(secret, s|nonce_r|nonce_s),
         layout, num_tokens, prompt_hash,
         FP8 scales if the pages are FP8) ─▶   checks the MAC and the layout, waits (up to the timeout)
                                               for the decode request to open the transfer
                                        ◀─    Want(first_page, num_pages) | Want(0, 0, error)
    Batch(transfer_id, ...) + bytes ... ─▶    each batch: checksums, then written under the lock, only
    Done(transfer_id)                  ─▶     if the transfer is still open (else dropped and counted)
                                        ◀─    Ack(ok)

Bytes are copied in user space only where they must be converted: the sender `sendmsg`s the pool's own
page runs, and a receiver whose pool has the wire's dtype `recvmsg_into`s them straight into its pages
(a close cuts that receive and waits for it). Other dtypes (and FP8 scales) are converted at the
receiver through `hearth.kv.convert`, with its own scales.

Both sides prove they hold the deployment's secret (a challenge each way, so neither a stray sender nor
a stray listener gets KV). A refused handshake fails the transfer at once on the decode side (its
request recomputes) rather than after the timeout. Wanting pages from `first_page` on is what makes the
decode server's own prefix-cache hits shrink the transfer.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import socket
import struct
import threading
from collections import OrderedDict

import msgspec
import torch
import xxhash

from hearth.kv.checksum import PageChecksumError, page_checksum, verify_page_checksum
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
    register_transport,
)

logger = logging.getLogger("hearth.kv_transfer")

PROTOCOL_VERSION = 1
_LENGTH = struct.Struct("!I")
MAX_HEADER_BYTES = 1 << 20
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
    checksums: list[int]
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


def _mac(secret: bytes, side: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, side + b"|" + first + b"|" + second, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, buffer: bytearray | memoryview) -> None:
    view = memoryview(buffer)
    while view:
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


def page_checksum_runs(runs: list[memoryview]) -> int:
    """`page_checksum` of the concatenated runs, without concatenating them (xxh3 streams)."""
    state = xxhash.xxh3_64()
    for run in runs:
        state.update(run)
    return state.intdigest()


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
    data = _encoder.encode(message)
    sock.sendall(_LENGTH.pack(len(data)) + data)


def recv_message(sock: socket.socket) -> Message:
    length = bytearray(_LENGTH.size)
    _recv_exact(sock, length)
    (size,) = _LENGTH.unpack(length)
    if size > MAX_HEADER_BYTES:
        raise TransferError(f"a {size}-byte header is too large")
    data = bytearray(size)
    _recv_exact(sock, data)
    return _decoder.decode(data)


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


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    address = endpoint.removeprefix("tcp://")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"not a tcp endpoint: {endpoint!r} (expected tcp://HOST:PORT)")
    return host.strip("[]"), int(port)


@register_transport("tcp")
class TCPTransport(KVTransport):
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
                sock, _ = server.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(sock,), name="hearth-kv-recv", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        transfer_id = None
        try:
            with sock:
                sock.settimeout(self.timeout_s)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                hello = _expect(recv_message(sock), Hello)
                assert isinstance(hello, Hello)
                transfer_id = hello.transfer_id
                if hello.version != PROTOCOL_VERSION:
                    raise TransferError(f"the sender speaks version {hello.version}, not {PROTOCOL_VERSION}")
                nonce = secrets.token_bytes(32)
                mac = _mac(self.secret, b"r", hello.nonce, nonce)
                send_message(sock, Challenge(nonce, mac, self.layout))
                auth = _expect(recv_message(sock), Auth)
                assert isinstance(auth, Auth)
                if not hmac.compare_digest(auth.mac, _mac(self.secret, b"s", nonce, hello.nonce)):
                    with self._cond:
                        self.counters.handshakes_refused += 1
                    message = "refused: the sender did not present this deployment's KV transfer secret"
                    logger.warning("KV transfer %s %s", transfer_id, message)
                    send_message(sock, Want(0, 0, message))
                    self._fail(transfer_id, message)
                    return
                mismatch = self.layout.mismatch(auth.layout)
                if mismatch:
                    logger.error("KV transfer %s refused: %s", transfer_id, mismatch)
                    send_message(sock, Want(0, 0, mismatch))
                    self._fail(transfer_id, mismatch)
                    return
                spec = self._claim(transfer_id)
                if spec is None:  # closed, not needed, or never opened in time: nothing to send
                    send_message(sock, Want(0, 0))
                    return
                if auth.prompt_hash != spec.prompt_hash or auth.num_tokens < spec.end_token:
                    why = (
                        "the prefill side computed another prompt"
                        if auth.prompt_hash != spec.prompt_hash
                        else f"the prefill side holds {auth.num_tokens} tokens, {spec.end_token} are needed"
                    )
                    send_message(sock, Want(0, 0, why))
                    self._fail(transfer_id, why)
                    return
                payload = self._open_payload(spec, auth.layout)
                try:
                    want = Want(spec.first_page, len(spec.page_ids))
                    send_message(sock, self._want_extras(want, payload))
                    self._receive_pages(sock, spec, payload, decode_scales(auth.scales, self.layout))
                finally:
                    self._close_payload(payload)
        except (OSError, TransferError, msgspec.DecodeError, ValueError) as exc:
            if transfer_id is not None:
                self._fail(transfer_id, f"transfer broken: {exc}")
        except Exception as exc:  # a bug here must still end the transfer (its request recomputes)
            logger.exception("KV transfer %s: receiving failed", transfer_id)
            if transfer_id is not None:
                self._fail(transfer_id, f"receiving failed: {type(exc).__name__}: {exc}")
        finally:
            buffer = getattr(self._local, "buffer", None)
            if buffer is not None:
                self._local.buffer = None
                self._buffers.give(buffer)
            if transfer_id is not None:
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
        self, sock: socket.socket, spec: ReceiveSpec, payload: object, src_scales: Scales | None
    ) -> None:
        layout = self.layout
        end_page = spec.first_page + len(spec.page_ids)
        next_page = spec.first_page
        while next_page < end_page:
            batch = _expect(recv_message(sock), Batch)
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
            if len(batch.checksums) != batch.num_pages:
                raise TransferError("a batch must carry one checksum per page")
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
            else:
                view = self._recv_payload(sock, payload, batch, page_bytes * batch.num_pages)
                for index, expected in enumerate(batch.checksums):
                    try:
                        verify_page_checksum(view[index * page_bytes : (index + 1) * page_bytes], expected)
                    except PageChecksumError as exc:
                        raise TransferError(f"page {batch.first_page + index}: {exc}") from exc
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
        _expect(recv_message(sock), Done)
        with self._cond:
            ok = self._open.get(spec.transfer_id) is spec
            if ok:
                del self._open[spec.transfer_id]
                self._remember(self._closed, spec.transfer_id, None)
                self._push(TransferEvent(spec.transfer_id, "received", True, num_pages=len(spec.page_ids)))
        send_message(sock, Ack(ok, None if ok else "the transfer was closed"))

    def _receive_into_pool(
        self, sock: socket.socket, spec: ReceiveSpec, batch: Batch, runs: list[memoryview]
    ) -> None:
        """The batch's bytes straight into the pool's pages (`recvmsg_into` over their runs): no buffer,
        no copy. The transfer is registered as writing while the bytes land; `close_receive` cuts the
        socket and waits for this to end, so no byte lands after it returns. The checksums are verified
        on the pool's bytes afterwards: a mismatch fails the transfer (its pages are recomputed, and
        they were never visible to a request, which waits for the load to end)."""
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
        per_page = len(runs) // batch.num_pages
        for index, expected in enumerate(batch.checksums):
            found = page_checksum_runs(runs[index * per_page : (index + 1) * per_page])
            if found != expected:
                raise TransferError(
                    f"page {batch.first_page + index}: page checksum mismatch: expected {expected:#018x}, "
                    f"found {found:#018x}"
                )

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
                nonce = secrets.token_bytes(32)
                send_message(sock, Hello(PROTOCOL_VERSION, spec.transfer_id, nonce))
                challenge = _expect(recv_message(sock), Challenge)
                assert isinstance(challenge, Challenge)
                # Auth goes out before our verdict on the receiver, so a wrong secret is reported on
                # both sides at once (the decode request recomputes without waiting for its timeout).
                layout = (
                    spec.layout or self.layout
                )  # a part of this pool's heads, for a receiver of another TP size
                send_message(
                    sock,
                    Auth(
                        _mac(self.secret, b"s", challenge.nonce, nonce),
                        layout,
                        spec.num_tokens,
                        spec.prompt_hash,
                        encode_scales(spec.source.scales),
                    ),
                )
                if not hmac.compare_digest(challenge.mac, _mac(self.secret, b"r", nonce, challenge.nonce)):
                    raise TransferError("the decode server did not prove it holds this deployment's secret")
                mismatch = layout.mismatch(challenge.layout)
                if mismatch:
                    raise TransferError(mismatch)
                want = _expect(recv_message(sock), Want)
                assert isinstance(want, Want)
                if want.error:
                    raise TransferError(want.error)
                num_pages = self._send_pages(sock, spec, want)
                if num_pages:
                    ack = _expect(recv_message(sock), Ack)
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

    def _send_pages(self, sock: socket.socket, spec: SendSpec, want: Want) -> int:
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
                per_page = len(runs) // count
                checksums = [
                    page_checksum_runs(runs[i * per_page : (i + 1) * per_page]) for i in range(count)
                ]
                header = _encoder.encode(
                    Batch(spec.transfer_id, first, count, dtype_name(spec.source.dtype), checksums)
                )
                for start in range(0, len(runs), _MAX_IOVECS):
                    parts = runs[start : start + _MAX_IOVECS]
                    _sendall_parts(
                        sock, [_LENGTH.pack(len(header)) + header, *parts] if start == 0 else parts
                    )
                with self._cond:
                    self.counters.pages_sent += count
                    self.counters.bytes_sent += count * page_bytes
                first += count
            send_message(sock, Done(spec.transfer_id))
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
                checksums = [page_checksum(raw[i * page_bytes : (i + 1) * page_bytes]) for i in range(count)]
                self._send_payload(sock, want, raw, offset)  # off-socket bytes land before their header
                header = _encoder.encode(
                    Batch(spec.transfer_id, first, count, dtype_name(spec.source.dtype), checksums, offset)
                )
                if want.remote is None:  # header and pages in one call (no concatenation copy)
                    _sendall_parts(sock, [_LENGTH.pack(len(header)) + header, raw])
                else:
                    sock.sendall(_LENGTH.pack(len(header)) + header)
                offset += len(raw)
                with self._cond:
                    self.counters.pages_sent += count
                    self.counters.bytes_sent += len(raw)
                first += count
        finally:
            self._buffers.give(staging)
        send_message(sock, Done(spec.transfer_id))
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
