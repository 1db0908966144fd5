"""Authenticated PD transfer (hearth.kv_transfer.auth and the TCP listener's bounds): the attacks of
issue 30 against real loopback sockets."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import msgspec
import pytest
import torch

from hearth.kv.pool import KVLayout, KVPool
from hearth.kv_transfer import make_transport, tcp
from hearth.kv_transfer.auth import (
    FrameAuthError,
    FrameMAC,
    MissingSecretError,
    instruction_refusal,
    is_transfer_id,
    read_secret,
    session_keys,
    sign_instruction,
)
from hearth.kv_transfer.base import KVTransport, ReceiveSpec, SendSpec, TransferEvent
from hearth.kv_transfer.pool_pages import PoolPageSource, PoolSink

SECRET = b"deployment-secret"
HASH = 99
TID = "0123456789abcdef0123456789abcdef"


def make_pool(dtype: torch.dtype = torch.float32) -> KVPool:
    pool = KVPool(KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, kv_dtype=dtype), 8)
    pool.storage.zero_()
    return pool


def transport(pool: KVPool, timeout_s: float = 5.0) -> KVTransport:
    return make_transport("tcp", pool.io.layout, SECRET, timeout_s, PoolSink(pool.io))


def wait_events(t: KVTransport, count: int, timeout_s: float = 10.0) -> list[TransferEvent]:
    events: list[TransferEvent] = []
    deadline = time.monotonic() + timeout_s
    while len(events) < count and time.monotonic() < deadline:
        events += t.events()
        time.sleep(0.005)
    assert len(events) >= count, events
    return events


def port_of(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


# ---- instructions --------------------------------------------------------------------------------


def test_a_signed_instruction_is_accepted_and_any_change_to_it_is_refused() -> None:
    fields = sign_instruction(SECRET, "prefill", TID, "http://127.0.0.1:9001", now_s=1000.0)
    ok = ("prefill", TID, "http://127.0.0.1:9001", fields["expires"], fields["signature"])
    assert instruction_refusal(SECRET, *ok, now_s=1001.0) is None  # type: ignore[arg-type]
    # the client points the prefill server at its own "decode server"
    forged = ("prefill", TID, "http://127.0.0.1:6666", fields["expires"], fields["signature"])
    assert "bad signature" in instruction_refusal(SECRET, *forged, now_s=1001.0)  # type: ignore[arg-type,operator]
    assert "bad signature" in instruction_refusal(b"other", *ok, now_s=1001.0)  # type: ignore[arg-type,operator]
    assert "no signature" in instruction_refusal(SECRET, "prefill", TID, "u", None, None)  # type: ignore[operator]
    assert "expired" in instruction_refusal(SECRET, *ok, now_s=1000.0 + 10_000)  # type: ignore[arg-type,operator]
    assert "hex" in instruction_refusal(SECRET, "prefill", "x\nFAKE LOG LINE", "u", 1, "s")  # type: ignore[operator]


def test_transfer_ids_are_fixed_length_lowercase_hex() -> None:
    assert is_transfer_id(TID)
    for bad in ("t1", TID + "0", TID.upper(), "z" * 32, TID[:-1] + "\n", 5, None):
        assert not is_transfer_id(bad)


def test_secrets_come_from_a_file_before_the_environment(tmp_path, monkeypatch) -> None:
    path = tmp_path / "secret"
    path.write_text("from-file\n")
    monkeypatch.setenv("X_SECRET", "from-env")
    assert read_secret("X_SECRET", "X_SECRET_FILE") == "from-env"
    monkeypatch.setenv("X_SECRET_FILE", str(path))
    assert read_secret("X_SECRET", "X_SECRET_FILE") == "from-file"
    path.write_text("")
    with pytest.raises(MissingSecretError, match="empty"):
        read_secret("X_SECRET", "X_SECRET_FILE")
    with pytest.raises(MissingSecretError, match="cannot read"):
        read_secret("X_SECRET", "X_SECRET_FILE", str(tmp_path / "missing"))


# ---- frames --------------------------------------------------------------------------------------


def test_a_frame_tag_covers_header_payload_and_order() -> None:
    sender_key, receiver_key = session_keys(SECRET, TID, b"a" * 32, b"b" * 32)
    assert sender_key != receiver_key
    assert session_keys(SECRET, TID, b"a" * 32, b"c" * 32)[0] != sender_key  # fresh nonces, fresh keys
    page = bytearray(os.urandom(4096))
    out = FrameMAC(sender_key)
    first, second = out.tag(b"h1", [memoryview(page)]), out.tag(b"h2")
    FrameMAC(sender_key).verify(first, b"h1", [memoryview(page[:1000]), memoryview(page[1000:])])  # runs
    for header, payload, tag in (
        (b"h1", [memoryview(page)], second),  # reordered
        (b"h2", [memoryview(page)], first),  # another header
        (b"h1", [memoryview(page[:-1])], first),  # a page cut short
    ):
        with pytest.raises(FrameAuthError):
            FrameMAC(sender_key).verify(tag, header, payload)
    with pytest.raises(FrameAuthError):
        FrameMAC(receiver_key).verify(first, b"h1", [memoryview(page)])  # the other direction's key


# ---- the relay attack ----------------------------------------------------------------------------


def _relay_frame(source: socket.socket, target: socket.socket, tagged: bool) -> bytes:
    length = tcp._LENGTH.size
    head = _read(source, length)
    (size,) = tcp._LENGTH.unpack(head)
    body = _read(source, size + (16 if tagged else 0))
    target.sendall(head + body)
    return body[:size]


def _read(sock: socket.socket, count: int) -> bytes:
    data = b""
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        assert chunk, "closed"
        data += chunk
    return data


@pytest.mark.parametrize("receiver_dtype", [torch.float32, torch.bfloat16])
def test_a_relayed_handshake_does_not_let_the_relay_send_its_own_pages(receiver_dtype) -> None:
    """Issue 30's poisoning: a fake decode server relays the real prefill's handshake to the real decode
    listener, then sends its own pages. They fail their tags, the load fails (the request recomputes) and
    the converted pages never reach the pool."""
    sender_pool, receiver_pool = make_pool(), make_pool(receiver_dtype)
    sender_pool.storage.normal_()
    sender, receiver = transport(sender_pool), transport(receiver_pool)
    endpoint = receiver.listen("127.0.0.1", 0)
    fake = socket.create_server(("127.0.0.1", 0))
    relayed: list[str] = []

    def relay() -> None:
        victim, _ = fake.accept()  # the real prefill server, sent here by a forged decode_url
        with victim, socket.create_connection(("127.0.0.1", port_of(endpoint))) as real:
            _relay_frame(victim, real, False)  # Hello
            _relay_frame(real, victim, False)  # Challenge
            _relay_frame(victim, real, False)  # Auth
            _relay_frame(real, victim, True)  # Want, tagged by the real decode server
            layout = sender_pool.io.layout
            forged = torch.full(layout.page_shape(), 666.0).numpy().tobytes()
            header = msgspec.msgpack.encode(tcp.Batch(TID, 0, 1, "float32"))
            real.sendall(tcp._LENGTH.pack(len(header)) + header + os.urandom(16) + forged)
            relayed.append("sent")
            try:
                real.recv(1)
            except OSError:
                pass

    thread = threading.Thread(target=relay, daemon=True)
    thread.start()
    try:
        receiver.open_receive(ReceiveSpec(TID, 0, [3], 3, HASH))
        sender.send(
            SendSpec(
                TID, f"tcp://127.0.0.1:{fake.getsockname()[1]}", PoolPageSource(sender_pool.io, [1]), 4, HASH
            )
        )
        (received,) = wait_events(receiver, 1)
        assert relayed == ["sent"]
        assert not received.ok and "MAC" in received.detail
        assert receiver.counters.frames_refused == 1 and receiver.counters.pages_received == 0
        if receiver_dtype != torch.float32:  # converted pages are verified before they are written
            assert receiver_pool.read_pages([3]).abs().sum() == 0
    finally:
        thread.join(5)
        fake.close()
        sender.close()
        receiver.close()


# ---- bounded listener ----------------------------------------------------------------------------


def test_a_hello_flood_keeps_nothing_logs_little_and_fails_no_transfer(caplog) -> None:
    """300 Hellos with 1 MiB transfer ids (and forged log lines in them): each is cut after the first
    256 bytes, nothing of them is remembered, the log has a line or two, and the open transfer they
    name is still delivered by its real sender."""
    sender_pool, receiver_pool = make_pool(), make_pool()
    sender_pool.storage.normal_()
    sender, receiver = transport(sender_pool), transport(receiver_pool)
    endpoint = receiver.listen("127.0.0.1", 0)
    receiver.open_receive(ReceiveSpec(TID, 0, [1], 3, HASH))
    caplog.set_level(logging.INFO, logger="hearth.kv_transfer")
    try:
        huge_id = (TID + "\nWARNING forged line\n") * 40000  # ~2 MiB
        hello = msgspec.msgpack.encode(tcp.Hello(tcp.PROTOCOL_VERSION, huge_id, b"n" * 32))
        for index in range(300):
            with socket.create_connection(("127.0.0.1", port_of(endpoint))) as sock:
                try:
                    sock.sendall(tcp._LENGTH.pack(len(hello)) + hello[: 1 << 20])
                except OSError:
                    pass  # refused while we were still sending: the point
            if index % 50 == 0:
                assert threading.active_count() < tcp.MAX_CONNECTIONS + 20
        deadline = time.monotonic() + 10
        while receiver.counters.handshakes_refused < 300 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert receiver.counters.handshakes_refused == 300
        state = receiver  # nothing about the flood was remembered
        assert not state._failed_early and not state._closed and not state._claimed  # type: ignore[attr-defined]
        records = [r for r in caplog.records if r.name == "hearth.kv_transfer"]
        assert 1 <= len(records) <= 2  # one warning per cause per interval, with its count
        assert all("forged" not in r.getMessage() for r in records)
        sender.send(SendSpec(TID, endpoint, PoolPageSource(sender_pool.io, [5]), 4, HASH))
        assert wait_events(receiver, 1)[0].ok
        assert torch.equal(receiver_pool.read_pages([1]), sender_pool.read_pages([5]))
    finally:
        sender.close()
        receiver.close()


def test_a_slow_drip_handshake_is_cut_at_the_total_deadline(monkeypatch) -> None:
    monkeypatch.setattr(tcp, "HANDSHAKE_TIMEOUT_S", 1.0)
    receiver = transport(make_pool(), timeout_s=30.0)  # each byte well within the per-receive timeout
    endpoint = receiver.listen("127.0.0.1", 0)
    hello = msgspec.msgpack.encode(tcp.Hello(tcp.PROTOCOL_VERSION, TID, b"n" * 32))
    frame = tcp._LENGTH.pack(len(hello)) + hello
    try:
        with socket.create_connection(("127.0.0.1", port_of(endpoint))) as sock:
            started = time.monotonic()
            closed_after = None
            for byte in frame:
                try:
                    sock.sendall(bytes([byte]))
                    sock.settimeout(0.25)
                    if sock.recv(1) == b"":
                        closed_after = time.monotonic() - started
                        break
                except TimeoutError:
                    continue
                except OSError:
                    closed_after = time.monotonic() - started
                    break
        assert closed_after is not None and closed_after < 3.0
        assert receiver.counters.handshakes_refused == 1
    finally:
        receiver.close()


def test_connections_past_the_cap_are_closed_at_once(monkeypatch) -> None:
    monkeypatch.setattr(tcp, "MAX_CONNECTIONS", 4)
    receiver = transport(make_pool())
    endpoint = receiver.listen("127.0.0.1", 0)
    idle = [socket.create_connection(("127.0.0.1", port_of(endpoint))) for _ in range(4)]
    try:
        time.sleep(0.2)
        with socket.create_connection(("127.0.0.1", port_of(endpoint))) as extra:
            extra.settimeout(2.0)
            assert extra.recv(1) == b""  # closed by the listener, not left waiting
        assert receiver.counters.connections_refused == 1
    finally:
        for sock in idle:
            sock.close()
        receiver.close()
