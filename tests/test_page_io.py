"""`hearth.kv.page_io`, the one owner of a page's bytes: page-major reads and writes for MHA (K and V) and
latent (MLA, one plane) pools, the pool's byte runs, converting writes with FP8 scales, rank shards, and a
latent pool's pages over the TCP transport into an FP8 latent pool."""

from __future__ import annotations

import time

import pytest
import torch

from hearth.kv.page_io import PageLayout, convert_values
from hearth.kv.pool import KVLayout, KVPool
from hearth.kv_transfer import make_transport
from hearth.kv_transfer.base import ReceiveSpec, SendSpec
from hearth.kv_transfer.pool_pages import PoolPageSource, PoolSink, TensorPageSource
from hearth.ops.fp8 import FP8_DTYPE

# Transfer ids as the router makes them (32 lowercase hex characters): a listener refuses any other.
TID_M, TID_H = "6d".ljust(32, "0"), "68".ljust(32, "0")
KINDS = {"mha": (2, 8), "latent": (1, 40)}  # kind -> (KV heads, head dim)


def make_pool(kind: str, dtype: torch.dtype = torch.float32, num_pages: int = 12) -> KVPool:
    heads, head_dim = KINDS[kind]
    pool = KVPool(KVLayout(3, heads, head_dim, 4, dtype, kind), num_pages)  # type: ignore[arg-type]
    pool.storage.zero_()
    return pool


def fp8_pool(kind: str) -> KVPool:
    pool = make_pool(kind, FP8_DTYPE)
    heads = pool.layout.num_kv_heads
    k = torch.linspace(0.01, 0.05, 3 * heads).view(3, heads)
    pool.set_scales(k, k if kind == "latent" else k * 2)
    return pool


@pytest.mark.parametrize("kind", ["mha", "latent"])
def test_pages_read_page_major_and_write_back_bit_exact(kind: str) -> None:
    pool = make_pool(kind)
    pool.storage.normal_()
    layout = pool.io.layout
    assert layout.num_planes == (1 if kind == "latent" else 2)
    pages = pool.io.read([5, 2])
    assert tuple(pages.shape) == (2, *layout.page_shape())
    # Page-major is the pool's layer-major `read_pages`, transposed.
    assert torch.equal(pages, pool.read_pages([5, 2]).permute(2, 0, 1, 3, 4, 5))
    other = make_pool(kind)
    other.io.write([0, 7], pages)
    assert torch.equal(other.io.read([0, 7]), pages)
    assert float(other.io.read([1]).abs().sum()) == 0.0  # nothing else written


@pytest.mark.parametrize("kind", ["mha", "latent"])
def test_page_runs_are_the_pages_bytes_in_wire_order(kind: str) -> None:
    pool = make_pool(kind)
    pool.storage.normal_()
    runs = pool.io.page_runs([4, 9])
    assert len(runs) == 2 * pool.layout.num_layers * pool.io.layout.num_planes
    joined = b"".join(bytes(run) for run in runs)
    assert joined == pool.io.read([4, 9]).numpy().tobytes()
    assert len(joined) == 2 * pool.io.layout.page_bytes()


@pytest.mark.parametrize("kind", ["mha", "latent"])
def test_writes_into_an_fp8_pool_quantize_with_its_scales(kind: str) -> None:
    source = make_pool(kind)
    source.storage.normal_()
    pages = source.io.read([1, 3])
    target = fp8_pool(kind)
    target.io.write([2, 6], pages)
    expected = convert_values(pages, FP8_DTYPE, None, target.io.scales)
    assert torch.equal(target.io.read([2, 6]).view(torch.uint8), expected.view(torch.uint8))
    # ... and back out of FP8 with those scales: within FP8's precision of the original values.
    back = make_pool(kind)
    back.io.write([0, 1], target.io.read([2, 6]), target.io.scales)
    assert torch.allclose(back.io.read([0, 1]), pages, rtol=0.07, atol=0.02)


def test_a_latent_pool_takes_one_scale_for_keys_and_values() -> None:
    pool = make_pool("latent", FP8_DTYPE)
    with pytest.raises(ValueError, match="must be equal"):
        pool.set_scales(torch.ones(3, 1), torch.full((3, 1), 2.0))


def test_a_shard_describes_its_place_and_files_under_its_own_key() -> None:
    layout = KVLayout(2, 1, 16, 8, torch.float32)
    whole = PageLayout.of(layout)
    first = PageLayout.of(layout, first_layer=0, total_layers=2, first_kv_head=0, total_kv_heads=2)
    second = PageLayout.of(layout, first_layer=0, total_layers=2, first_kv_head=1, total_kv_heads=2)
    key = bytes(16)
    assert whole.shard_key(key) == key and not whole.is_shard
    assert len({first.shard_key(key), second.shard_key(key), key}) == 3
    assert "h1+1of2" in second.describe()
    assert first.mismatch(second) is not None and first.mismatch(first) is None


def test_latent_pages_cross_tcp_into_an_fp8_latent_pool() -> None:
    sender_pool, receiver_pool = make_pool("latent"), fp8_pool("latent")
    sender_pool.storage.normal_()
    sender = make_transport("tcp", sender_pool.io.layout, b"k", 5.0, PoolSink(sender_pool.io))
    receiver = make_transport("tcp", receiver_pool.io.layout, b"k", 5.0, PoolSink(receiver_pool.io))
    try:
        endpoint = receiver.listen("127.0.0.1", 0)
        receiver.open_receive(ReceiveSpec(TID_M, 0, [8, 3, 5], 11, 7))
        sender.send(SendSpec(TID_M, endpoint, PoolPageSource(sender_pool.io, [2, 0, 9]), 12, 7))
        deadline = time.monotonic() + 10
        events = []
        while not events and time.monotonic() < deadline:
            events = receiver.events()
            time.sleep(0.01)
        assert events and events[0].ok, events
        expected = convert_values(sender_pool.io.read([2, 0, 9]), FP8_DTYPE, None, receiver_pool.io.scales)
        assert torch.equal(receiver_pool.io.read([8, 3, 5]).view(torch.uint8), expected.view(torch.uint8))
    finally:
        sender.close()
        receiver.close()


def test_a_part_of_the_heads_goes_out_under_its_own_layout() -> None:
    """Prefill TP=1 -> decode TP=2: each decode rank is sent the heads it holds, described as its shard."""
    sender_pool = make_pool("mha")
    sender_pool.storage.normal_()
    part_layout = PageLayout.of(
        KVLayout(3, 1, 8, 4, torch.float32), first_layer=0, total_layers=3, first_kv_head=1, total_kv_heads=2
    )
    receiver_pool = KVPool(KVLayout(3, 1, 8, 4, torch.float32), 6, page_layout=part_layout)
    receiver_pool.storage.zero_()
    sender = make_transport("tcp", sender_pool.io.layout, b"k", 5.0, PoolSink(sender_pool.io))
    receiver = make_transport("tcp", part_layout, b"k", 5.0, PoolSink(receiver_pool.io))
    try:
        endpoint = receiver.listen("127.0.0.1", 0)
        receiver.open_receive(ReceiveSpec(TID_H, 0, [4, 1], 7, 3))
        heads = sender_pool.io.read([6, 2])[:, :, :, :, 1:2].contiguous()
        sender.send(SendSpec(TID_H, endpoint, TensorPageSource(heads, None), 8, 3, layout=part_layout))
        deadline = time.monotonic() + 10
        events = []
        while not events and time.monotonic() < deadline:
            events = receiver.events()
            time.sleep(0.01)
        assert events and events[0].ok, events
        assert torch.equal(receiver_pool.io.read([4, 1]), heads)
    finally:
        sender.close()
        receiver.close()
