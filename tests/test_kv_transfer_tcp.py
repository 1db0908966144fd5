"""The TCP KV transport between two real pools over real loopback sockets."""

from __future__ import annotations

import threading
import time

import msgspec
import pytest
import torch

from hearth.kv.pool import KVLayout, KVPool
from hearth.kv_transfer import make_transport
from hearth.kv_transfer.base import KVTransport, ReceiveSpec, SendSpec, TransferEvent
from hearth.kv_transfer.pool_pages import PoolPageSource, PoolSink

SECRET = b"s3cret"
HASH = 1234


def tid(name: str) -> str:
    """A transfer id as the router makes them (32 lowercase hex characters), readable in failures."""
    return name.encode().hex().ljust(32, "0")


def make_pool(dtype: torch.dtype = torch.float32, num_pages: int = 16, heads: int = 2) -> KVPool:
    pool = KVPool(
        KVLayout(num_layers=3, num_kv_heads=heads, head_dim=8, page_size=4, kv_dtype=dtype), num_pages
    )
    pool.storage.zero_()
    return pool


def transport(pool: KVPool, secret: bytes = SECRET, timeout_s: float = 5.0) -> KVTransport:
    return make_transport("tcp", pool.io.layout, secret, timeout_s, PoolSink(pool.io))


def wait_events(t: KVTransport, count: int, timeout_s: float = 10.0) -> list[TransferEvent]:
    events: list[TransferEvent] = []
    deadline = time.monotonic() + timeout_s
    while len(events) < count and time.monotonic() < deadline:
        events += t.events()
        time.sleep(0.005)
    assert len(events) >= count, events
    return events


@pytest.fixture
def pair():
    sender_pool, receiver_pool = make_pool(), make_pool(torch.bfloat16)
    sender, receiver = transport(sender_pool), transport(receiver_pool)
    endpoint = receiver.listen("127.0.0.1", 0)
    yield sender_pool, receiver_pool, sender, receiver, endpoint
    sender.close()
    receiver.close()


def test_pages_arrive_converted_and_only_the_wanted_ones(pair) -> None:
    sender_pool, receiver_pool, sender, receiver, endpoint = pair
    sender_pool.storage.normal_()
    source_pages = [3, 7, 1, 9, 4]  # the prefill request's pages 0..4
    # The decode side already holds request pages 0 and 1 (its own prefix cache): it wants 2..4.
    receiver.open_receive(ReceiveSpec(tid("t1"), 2, [11, 5, 6], 5 * 4 - 1, HASH))
    sender.send(SendSpec(tid("t1"), endpoint, PoolPageSource(sender_pool.io, source_pages), 5 * 4, HASH))
    (sent,) = wait_events(sender, 1)
    (received,) = wait_events(receiver, 1)
    assert sent.ok and received.ok and sent.num_pages == 3 and received.num_pages == 3
    expected = sender_pool.read_pages([1, 9, 4]).to(torch.bfloat16)
    assert torch.equal(receiver_pool.read_pages([11, 5, 6]), expected)
    untouched = [p for p in range(16) if p not in (11, 5, 6)]
    assert receiver_pool.read_pages(untouched).abs().sum() == 0
    assert receiver.counters.pages_received == 3 and sender.counters.pages_sent == 3


def test_many_batches_stream_on_one_connection(pair) -> None:
    sender_pool, receiver_pool, sender, receiver, endpoint = pair
    sender.batch_bytes = 1  # one page per batch
    sender_pool.storage.normal_()
    receiver.open_receive(ReceiveSpec(tid("t2"), 0, list(range(8)), 30, HASH))
    sender.send(SendSpec(tid("t2"), endpoint, PoolPageSource(sender_pool.io, list(range(8, 16))), 32, HASH))
    assert wait_events(receiver, 1)[0].ok
    assert torch.equal(
        receiver_pool.read_pages(list(range(8))), sender_pool.read_pages(list(range(8, 16))).bfloat16()
    )


def test_wrong_secret_is_refused_and_leaves_the_transfer_to_its_real_sender() -> None:
    """A sender without the secret is refused (both sides say why) but cannot fail the transfer it
    named: the real sender, which comes later, still delivers it."""
    sender_pool, receiver_pool = make_pool(), make_pool()
    sender_pool.storage.normal_()
    stranger, sender, receiver = (
        transport(sender_pool, b"wrong"),
        transport(sender_pool),
        transport(receiver_pool),
    )
    try:
        endpoint = receiver.listen("127.0.0.1", 0)
        receiver.open_receive(ReceiveSpec(tid("t3"), 0, [0, 1], 5, HASH))
        stranger.send(SendSpec(tid("t3"), endpoint, PoolPageSource(sender_pool.io, [0, 1]), 8, HASH))
        (refused,) = wait_events(stranger, 1)
        assert not refused.ok and "secret" in refused.detail
        time.sleep(0.2)
        assert receiver.events() == [] and receiver.counters.handshakes_refused == 1
        sender.send(SendSpec(tid("t3"), endpoint, PoolPageSource(sender_pool.io, [2, 3]), 8, HASH))
        (received,) = wait_events(receiver, 1)
        assert received.ok and receiver.counters.pages_received == 2
        assert torch.equal(receiver_pool.read_pages([0, 1]), sender_pool.read_pages([2, 3]))
    finally:
        for t in (stranger, sender, receiver):
            t.close()


def test_layout_mismatch_is_a_clear_error_on_both_sides() -> None:
    sender_pool, receiver_pool = make_pool(heads=4), make_pool(heads=2)
    sender, receiver = transport(sender_pool), transport(receiver_pool)
    try:
        endpoint = receiver.listen("127.0.0.1", 0)
        receiver.open_receive(ReceiveSpec(tid("t4"), 0, [0], 3, HASH))
        sender.send(SendSpec(tid("t4"), endpoint, PoolPageSource(sender_pool.io, [0]), 4, HASH))
        (sent,) = wait_events(sender, 1)
        (received,) = wait_events(receiver, 1)
        for event in (sent, received):
            assert not event.ok and "KV layout mismatch" in event.detail and "h4x8" in event.detail
    finally:
        sender.close()
        receiver.close()


def test_another_prompt_or_too_few_tokens_fail_the_load(pair) -> None:
    sender_pool, _, sender, receiver, endpoint = pair
    receiver.open_receive(ReceiveSpec(tid("t5"), 0, [0, 1], 7, HASH))
    sender.send(SendSpec(tid("t5"), endpoint, PoolPageSource(sender_pool.io, [0, 1]), 8, HASH + 1))
    assert not wait_events(receiver, 1)[0].ok
    receiver.open_receive(ReceiveSpec(tid("t6"), 0, [0, 1], 7, HASH))
    sender.send(
        SendSpec(tid("t6"), endpoint, PoolPageSource(sender_pool.io, []), 0, HASH)
    )  # an aborted prefill
    assert "holds 0 tokens" in wait_events(receiver, 1)[0].detail


def test_a_closed_transfer_tells_a_late_sender_nothing_is_wanted(pair) -> None:
    sender_pool, _, sender, receiver, endpoint = pair
    receiver.close_receive(tid("t7"))
    sender.send(SendSpec(tid("t7"), endpoint, PoolPageSource(sender_pool.io, [0]), 4, HASH))
    (sent,) = wait_events(sender, 1)
    assert sent.ok and sent.detail == "nothing wanted" and receiver.events() == []


class GatedSource:
    """A prefill's pages whose read waits for the test: the transfer is paused mid-flight."""

    def __init__(self, pool: KVPool, page_ids: list[int]) -> None:
        self.inner = PoolPageSource(pool.io, page_ids)
        self.reading = threading.Event()
        self.go = threading.Event()

    @property
    def num_pages(self) -> int:
        return self.inner.num_pages

    @property
    def dtype(self) -> torch.dtype:
        return self.inner.dtype

    @property
    def scales(self):  # type: ignore[no-untyped-def]
        return self.inner.scales

    def read_into(self, first: int, count: int, out: torch.Tensor) -> None:
        self.reading.set()
        assert self.go.wait(10)
        self.inner.read_into(first, count, out)


def test_a_late_write_never_lands_in_reused_pages(pair) -> None:
    """The SGLang bug: a transfer is cancelled (abort, timeout) while its pages are in flight, the
    pages are freed and handed to another request; the old transfer's pages must not land there."""
    sender_pool, receiver_pool, sender, receiver, endpoint = pair
    sender_pool.storage.fill_(1.0)
    source = GatedSource(sender_pool, [0, 1])
    receiver.open_receive(ReceiveSpec(tid("old"), 0, [5, 6], 7, HASH))
    sender.send(SendSpec(tid("old"), endpoint, source, 8, HASH))
    assert source.reading.wait(10)  # handshake done, pages wanted, the sender is about to send them
    receiver.close_receive(tid("old"))  # the decode request was aborted: from here no write may land
    # Pages 5 and 6 now belong to a new request that computed its own KV there.
    receiver_pool.write_pages([5, 6], torch.full((3, 2, 2, 4, 2, 8), 7.0))
    source.go.set()
    (sent,) = wait_events(sender, 1)
    assert not sent.ok
    assert receiver.counters.late_writes_dropped == 2 and receiver.counters.pages_received == 0
    assert torch.all(receiver_pool.read_pages([5, 6]) == 7.0)
    assert receiver.events() == []  # a closed receive is not answered


def handshake(endpoint: str, transfer_id: str, layout, num_tokens: int):  # type: ignore[no-untyped-def]
    """A hand-made sender with the secret: the socket and its frame MACs (out, in) after a Want."""
    import socket

    from hearth.kv_transfer.auth import FrameMAC, session_keys
    from hearth.kv_transfer.tcp import (
        PROTOCOL_VERSION,
        Auth,
        Challenge,
        Hello,
        Want,
        auth_mac,
        recv_message,
        recv_verified,
        send_message,
    )

    sock = socket.create_connection(("127.0.0.1", int(endpoint.rsplit(":", 1)[1])))
    nonce = b"n" * 32
    send_message(sock, Hello(PROTOCOL_VERSION, transfer_id, nonce))
    challenge = recv_message(sock)
    assert isinstance(challenge, Challenge)
    auth = Auth(b"", layout, num_tokens, HASH)
    auth.mac = auth_mac(SECRET, transfer_id, nonce, challenge.nonce, auth)
    send_message(sock, auth)
    sender_key, receiver_key = session_keys(SECRET, transfer_id, nonce, challenge.nonce)
    frames_out, frames_in = FrameMAC(sender_key), FrameMAC(receiver_key)
    assert isinstance(recv_verified(sock, frames_in, Want), Want)
    return sock, frames_out, frames_in


def test_prefill_death_mid_transfer_fails_the_load(pair) -> None:
    sender_pool, _, _, receiver, endpoint = pair
    receiver.open_receive(ReceiveSpec(tid("t8"), 0, [0, 1], 7, HASH))
    sock, _, _ = handshake(endpoint, tid("t8"), sender_pool.io.layout, 8)
    with sock:
        sock.sendall(b"\x00\x00")  # half a frame, then the process is gone
    (received,) = wait_events(receiver, 1)
    assert not received.ok and "broken" in received.detail


@pytest.mark.parametrize("receiver_dtype", [torch.float32, torch.bfloat16])
def test_a_page_changed_after_its_tag_was_made_fails_the_transfer(pair, receiver_dtype) -> None:
    """Straight into the pool (same dtype) or converted (bf16): a batch whose bytes do not match its tag
    fails the transfer, and converted pages are never written."""
    from hearth.kv_transfer.tcp import _LENGTH, Batch

    sender_pool = pair[0]
    receiver_pool = make_pool(receiver_dtype)
    receiver = transport(receiver_pool)
    endpoint = receiver.listen("127.0.0.1", 0)
    try:
        receiver.open_receive(ReceiveSpec(tid("t9"), 0, [2], 3, HASH))
        layout = sender_pool.io.layout
        raw = bytearray(torch.ones(layout.page_shape()).numpy().tobytes())
        sock, frames_out, _ = handshake(endpoint, tid("t9"), layout, 4)
        with sock:
            header = msgspec.msgpack.encode(Batch(tid("t9"), 0, 1, "float32"))
            tag = frames_out.tag(header, (memoryview(raw),))
            raw[100] ^= 1  # one bit flipped on the way
            sock.sendall(_LENGTH.pack(len(header)) + header + tag + bytes(raw))
            (received,) = wait_events(receiver, 1)
        assert not received.ok and "MAC" in received.detail
        assert receiver.counters.frames_refused == 1
        if receiver_dtype != torch.float32:
            assert receiver_pool.read_pages([2]).abs().sum() == 0
    finally:
        receiver.close()


def fp8_pool(scale_base: float, num_pages: int = 16) -> KVPool:
    """An FP8 pool with distinct per (layer, KV head) scales, so a test fails if scales are ignored."""
    pool = make_pool(torch.float8_e4m3fn, num_pages)
    steps = torch.arange(3 * 2, dtype=torch.float32).view(3, 2)
    pool.set_scales(scale_base * (1 + steps), scale_base * (2 + steps))
    return pool


def test_bf16_pages_become_fp8_with_the_receivers_own_scales() -> None:
    """Precision per role: a BF16 prefill pool into an FP8 decode pool, quantized at the receiver with its
    own scales; bit-exact against the conversion done by hand."""
    from hearth.kv.convert import convert_pages

    sender_pool, receiver_pool = make_pool(torch.bfloat16), fp8_pool(0.01)
    sender_pool.storage.normal_()
    sender, receiver = transport(sender_pool), transport(receiver_pool)
    try:
        endpoint = receiver.listen("127.0.0.1", 0)
        receiver.open_receive(ReceiveSpec(tid("f1"), 0, [4, 2, 9], 11, HASH))
        sender.send(SendSpec(tid("f1"), endpoint, PoolPageSource(sender_pool.io, [1, 3, 5]), 12, HASH))
        assert wait_events(receiver, 1)[0].ok and wait_events(sender, 1)[0].ok
        scales = (receiver_pool.k_scales, receiver_pool.v_scales)
        expected = convert_pages(sender_pool.read_pages([1, 3, 5]), torch.float8_e4m3fn, None, scales)
        got = receiver_pool.read_pages([4, 2, 9])
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
        # the scales were applied: dequantized, the pages are the sent values to FP8 precision
        real = got.float() * torch.stack(scales, 1)[:, :, None, None, :, None]
        sent = sender_pool.read_pages([1, 3, 5]).float()
        assert torch.allclose(real, sent, rtol=0.07, atol=0.01 * 2 / 16)
    finally:
        sender.close()
        receiver.close()


def test_fp8_pages_with_other_scales_are_rescaled_with_the_senders_scales() -> None:
    from hearth.kv.convert import convert_pages, pool_scales

    sender_pool, receiver_pool = fp8_pool(0.02), fp8_pool(0.005)
    sender_pool.storage.copy_(torch.randn(sender_pool.storage.shape).clamp(-4, 4).to(torch.float8_e4m3fn))
    sender, receiver = transport(sender_pool), transport(receiver_pool)
    try:
        endpoint = receiver.listen("127.0.0.1", 0)
        receiver.open_receive(ReceiveSpec(tid("f2"), 0, [0, 1], 7, HASH))
        sender.send(SendSpec(tid("f2"), endpoint, PoolPageSource(sender_pool.io, [6, 7]), 8, HASH))
        assert wait_events(receiver, 1)[0].ok
        expected = convert_pages(
            sender_pool.read_pages([6, 7]),
            torch.float8_e4m3fn,
            pool_scales(sender_pool),
            pool_scales(receiver_pool),
        )
        got = receiver_pool.read_pages([0, 1])
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
        # not a raw byte copy: the receiver's scales differ, so the stored values must too
        assert not torch.equal(got.view(torch.uint8), sender_pool.read_pages([6, 7]).view(torch.uint8))
    finally:
        sender.close()
        receiver.close()


def test_fp8_pages_into_a_bf16_pool_are_dequantized() -> None:
    sender_pool, receiver_pool = fp8_pool(0.03), make_pool(torch.bfloat16)
    sender_pool.storage.copy_(torch.randn(sender_pool.storage.shape).to(torch.float8_e4m3fn))
    sender, receiver = transport(sender_pool), transport(receiver_pool)
    try:
        endpoint = receiver.listen("127.0.0.1", 0)
        receiver.open_receive(ReceiveSpec(tid("f3"), 0, [3], 3, HASH))
        sender.send(SendSpec(tid("f3"), endpoint, PoolPageSource(sender_pool.io, [2]), 4, HASH))
        assert wait_events(receiver, 1)[0].ok
        scales = torch.stack((sender_pool.k_scales, sender_pool.v_scales), 1)[:, :, None, None, :, None]
        expected = (sender_pool.read_pages([2]).float() * scales).to(torch.bfloat16)
        assert torch.equal(receiver_pool.read_pages([3]), expected)
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize("zero_copy", [True, False])
def test_both_send_paths_deliver_the_same_bytes(zero_copy: bool) -> None:
    """Pages sent straight from the pool's runs (sendmsg) or gathered into a staging buffer first."""
    sender_pool, receiver_pool = make_pool(torch.bfloat16), make_pool(torch.bfloat16)
    sender_pool.storage.normal_()
    sender, receiver = transport(sender_pool), transport(receiver_pool)
    sender.zero_copy_send = zero_copy  # type: ignore[attr-defined]
    sender.batch_bytes = 3 * sender_pool.layout.bytes_per_page  # type: ignore[attr-defined]  # 3 batches
    try:
        endpoint = receiver.listen("127.0.0.1", 0)
        source_pages = [15, 0, 7, 3, 8, 2, 11]
        receiver.open_receive(ReceiveSpec(tid("z"), 0, [1, 4, 6, 9, 10, 12, 14], 27, HASH))
        sender.send(SendSpec(tid("z"), endpoint, PoolPageSource(sender_pool.io, source_pages), 28, HASH))
        assert wait_events(receiver, 1)[0].ok and wait_events(sender, 1)[0].ok
        assert torch.equal(
            receiver_pool.read_pages([1, 4, 6, 9, 10, 12, 14]), sender_pool.read_pages(source_pages)
        )
    finally:
        sender.close()
        receiver.close()


def test_closing_while_bytes_land_straight_in_the_pool_stops_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """Same-dtype pages are received straight into the pool's pages. A close in the middle of a batch
    must cut that receive and return only when no byte of it can land any more."""
    from hearth.kv_transfer import tcp

    sender_pool, receiver_pool = make_pool(torch.bfloat16), make_pool(torch.bfloat16)
    sender_pool.storage.fill_(1.0)
    sender, receiver = transport(sender_pool), transport(receiver_pool)
    midway, go = threading.Event(), threading.Event()
    original = tcp._sendall_parts

    def stalling(sock, parts):  # type: ignore[no-untyped-def]
        if len(parts) > 2:  # a batch: its header and the first runs, then a stall mid-batch
            original(sock, parts[:3])
            midway.set()
            assert go.wait(10)
            parts = parts[3:]
        original(sock, parts)

    monkeypatch.setattr(tcp, "_sendall_parts", stalling)
    try:
        endpoint = receiver.listen("127.0.0.1", 0)
        receiver.open_receive(ReceiveSpec(tid("mid"), 0, [5, 6], 7, HASH))
        sender.send(SendSpec(tid("mid"), endpoint, PoolPageSource(sender_pool.io, [0, 1]), 8, HASH))
        assert midway.wait(10)
        deadline = time.monotonic() + 10
        while tid("mid") not in receiver._writing:  # type: ignore[attr-defined]  # in recvmsg_into now
            assert time.monotonic() < deadline
            time.sleep(0.01)
        started = time.monotonic()
        receiver.close_receive(tid("mid"))
        assert time.monotonic() - started < 5  # cut, not waited out to the socket timeout
        # The pages are freed and reused by another request, which writes its own KV there.
        receiver_pool.write_pages([5, 6], torch.full_like(receiver_pool.read_pages([5, 6]), 7.0))
        go.set()
        (sent,) = wait_events(sender, 1)
        assert not sent.ok
        time.sleep(0.2)
        assert bool((receiver_pool.read_pages([5, 6]) == 7.0).all())  # nothing of the old transfer landed
        assert receiver.events() == []  # a closed receive is not answered
    finally:
        go.set()
        sender.close()
        receiver.close()
