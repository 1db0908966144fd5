"""`--kv-transfer mooncake`: Mooncake Transfer Engine binds 0.0.0.0, so the real transfers run inside a
private network namespace (`unshare -rn`, loopback up) that nothing else can reach."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

INSIDE = os.environ.get("HEARTH_TEST_IN_NETNS") == "1"
HAVE_MOONCAKE = importlib.util.find_spec("mooncake") is not None


def _unshare_works() -> bool:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return False
    return subprocess.run(["unshare", "-rn", "true"], capture_output=True, timeout=30).returncode == 0


@pytest.mark.skipif(INSIDE, reason="the outer half")
def test_mooncake_transfers_in_a_private_network_namespace() -> None:
    if not HAVE_MOONCAKE:
        pytest.skip("mooncake-transfer-engine is not installed")
    if not _unshare_works():
        pytest.skip("unshare -rn (a private network namespace) is not permitted here")
    here = Path(__file__)
    command = f"ip link set lo up && {sys.executable} -m pytest -q -p no:cacheprovider {here} -k inner"
    env = {**os.environ, "HEARTH_TEST_IN_NETNS": "1"}
    result = subprocess.run(
        ["unshare", "-rn", "sh", "-c", command],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=here.parent.parent,
    )
    assert result.returncode == 0 and " passed" in result.stdout, (
        result.stdout[-4000:] + result.stderr[-4000:]
    )


@pytest.fixture
def pair():
    from test_kv_transfer_tcp import make_pool

    from hearth.kv_transfer import make_transport
    from hearth.kv_transfer.pool_pages import PoolSink

    sender_pool, receiver_pool = make_pool(), make_pool(torch.bfloat16)
    sender = make_transport("mooncake", sender_pool.io.layout, b"k", 10.0, PoolSink(sender_pool.io))
    receiver = make_transport("mooncake", receiver_pool.io.layout, b"k", 10.0, PoolSink(receiver_pool.io))
    endpoint = receiver.listen("127.0.0.1", 0)
    yield sender_pool, receiver_pool, sender, receiver, endpoint
    sender.close()
    receiver.close()


@pytest.mark.skipif(not INSIDE, reason="runs inside the private network namespace")
def test_inner_pages_arrive_through_mooncake(pair) -> None:
    from test_kv_transfer_tcp import HASH, tid, wait_events

    from hearth.kv_transfer.base import ReceiveSpec, SendSpec
    from hearth.kv_transfer.pool_pages import PoolPageSource

    sender_pool, receiver_pool, sender, receiver, endpoint = pair
    sender.batch_bytes = 1  # one page per batch: several one-sided writes at offsets
    sender_pool.storage.normal_()
    receiver.open_receive(ReceiveSpec(tid("m1"), 1, [11, 5, 6], 16, HASH))
    sender.send(SendSpec(tid("m1"), endpoint, PoolPageSource(sender_pool.io, [3, 7, 1, 9]), 16, HASH))
    (sent,) = wait_events(sender, 1)
    (received,) = wait_events(receiver, 1)
    assert sent.ok and received.ok, (sent, received)
    assert torch.equal(receiver_pool.read_pages([11, 5, 6]), sender_pool.read_pages([7, 1, 9]).bfloat16())
    assert receiver.counters.pages_received == 3


@pytest.mark.skipif(not INSIDE, reason="runs inside the private network namespace")
def test_inner_a_late_mooncake_write_never_reaches_the_pool(pair) -> None:
    from test_kv_transfer_tcp import HASH, GatedSource, tid, wait_events

    from hearth.kv_transfer.base import ReceiveSpec, SendSpec

    sender_pool, receiver_pool, sender, receiver, endpoint = pair
    sender_pool.storage.fill_(1.0)
    source = GatedSource(sender_pool, [0, 1])
    receiver.open_receive(ReceiveSpec(tid("late"), 0, [5, 6], 7, HASH))
    sender.send(SendSpec(tid("late"), endpoint, source, 8, HASH))
    assert source.reading.wait(10)
    receiver.close_receive(tid("late"))
    receiver_pool.write_pages([5, 6], torch.full((3, 2, 2, 4, 2, 8), 7.0))
    source.go.set()
    (sent,) = wait_events(sender, 1)
    assert not sent.ok
    assert torch.all(receiver_pool.read_pages([5, 6]) == 7.0)
    assert receiver.counters.late_writes_dropped == 2


@pytest.mark.skipif(not INSIDE, reason="runs inside the private network namespace")
def test_inner_bytes_written_into_staging_by_anyone_else_fail_the_tag(pair, monkeypatch) -> None:
    """Transfer Engine lets any peer on the network write into a registered staging buffer. Such bytes
    fail the batch's tag (sent on the authenticated control connection) and never reach the pool."""
    from test_kv_transfer_tcp import HASH, tid, wait_events

    from hearth.kv_transfer import mooncake
    from hearth.kv_transfer.base import ReceiveSpec, SendSpec
    from hearth.kv_transfer.pool_pages import PoolPageSource

    sender_pool, receiver_pool, sender, receiver, endpoint = pair
    sender_pool.storage.normal_()
    original = mooncake.MooncakeTransport._recv_payload

    def overwritten(self, sock, payload, batch, size):  # type: ignore[no-untyped-def]
        view = original(self, sock, payload, batch, size)
        view[0:64] = bytes(64)  # a stranger's one-sided write landed first
        return view

    monkeypatch.setattr(mooncake.MooncakeTransport, "_recv_payload", overwritten)
    receiver.open_receive(ReceiveSpec(tid("m2"), 0, [2, 3], 7, HASH))
    sender.send(SendSpec(tid("m2"), endpoint, PoolPageSource(sender_pool.io, [0, 1]), 8, HASH))
    (received,) = wait_events(receiver, 1)
    assert not received.ok and "MAC" in received.detail
    assert receiver_pool.read_pages([2, 3]).abs().sum() == 0 and receiver.counters.pages_received == 0


@pytest.mark.skipif(not INSIDE, reason="runs inside the private network namespace")
def test_inner_one_rank_shard_of_heads_arrives_through_mooncake() -> None:
    """A TP=1 prefill sends a TP=2 decode rank the heads it holds: the part's layout sizes the receiver's
    staging buffer and the one-sided writes."""
    from test_kv_transfer_tcp import HASH, make_pool, tid, wait_events

    from hearth.kv.page_io import PageLayout
    from hearth.kv.pool import KVLayout, KVPool
    from hearth.kv_transfer import make_transport
    from hearth.kv_transfer.base import ReceiveSpec, SendSpec
    from hearth.kv_transfer.pool_pages import PoolSink, TensorPageSource

    sender_pool = make_pool()
    sender_pool.storage.normal_()
    rank_layout = KVLayout(3, 1, 8, 4, torch.float32)
    part = PageLayout.of(rank_layout, first_layer=0, total_layers=3, first_kv_head=1, total_kv_heads=2)
    receiver_pool = KVPool(rank_layout, 8, page_layout=part)
    sender = make_transport("mooncake", sender_pool.io.layout, b"k", 10.0, PoolSink(sender_pool.io))
    receiver = make_transport("mooncake", part, b"k", 10.0, PoolSink(receiver_pool.io))
    try:
        endpoint = receiver.listen("127.0.0.1", 0)
        heads = sender_pool.io.read([2, 4, 6])[:, :, :, :, 1:2].contiguous()
        receiver.open_receive(ReceiveSpec(tid("part"), 0, [7, 0, 3], 11, HASH))
        sender.send(SendSpec(tid("part"), endpoint, TensorPageSource(heads, None), 12, HASH, layout=part))
        (sent,) = wait_events(sender, 1)
        (received,) = wait_events(receiver, 1)
        assert sent.ok and received.ok, (sent, received)
        assert torch.equal(receiver_pool.io.read([7, 0, 3]), heads)
    finally:
        sender.close()
        receiver.close()
