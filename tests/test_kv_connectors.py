"""The scheduler halves of the KV connectors (`hearth.engine.kv_connectors`): what they put in the step's
KV ops, and how they merge the ranks' events (a load is done only when every rank's shard is in; a PD
prefill's pages stay held until every rank's sender is done)."""

from __future__ import annotations

from hearth.contracts.kv_ops import (
    CancelLoad,
    KVEvent,
    PeerClose,
    PeerReceive,
    PeerSend,
    TierLoad,
    TierSave,
    TierSpill,
)
from hearth.engine.kv_connector import KVLoadPart, KVOpQueue
from hearth.engine.kv_connectors.peer import PeerKVConnector
from hearth.engine.kv_connectors.tiers import TierConnector
from hearth.engine.messages import KVTransferParams
from hearth.engine.request import Request
from hearth.engine.sampling_params import SamplingParams
from hearth.kv.manager import KVCacheManager

PAGE = 4


def request(request_id: str, transfer: KVTransferParams | None = None) -> Request:
    return Request(request_id, list(range(1, 18)), SamplingParams(), b"r" * 16, 0, 64, kv_transfer=transfer)


def tier_connector(world_size: int = 2) -> tuple[TierConnector, KVOpQueue]:
    ops = KVOpQueue()
    return TierConnector(ops, PAGE, world_size, lambda keys: 0, list), ops


def test_a_tier_load_lands_with_the_fewest_pages_any_rank_loaded():
    tiers, ops = tier_connector()
    tiers.start_load(KVLoadPart(request("a"), "tier", 0, 12, [4, 5, 6], [1, 1, 1], [b"k0", b"k1", b"k2"]))
    assert ops.take() == [TierLoad("a", [b"k0", b"k1", b"k2"], [4, 5, 6])]
    assert tiers.in_flight
    tiers.on_events([KVEvent("loaded", 1, "a", num_pages=3)])
    assert tiers.poll() == []  # rank 0 has not answered
    tiers.on_events([KVEvent("loaded", 0, "a", num_pages=2)])
    (result,) = tiers.poll()
    assert result.num_tokens == 2 * PAGE and not tiers.in_flight


def test_a_failed_rank_means_nothing_loaded():
    tiers, _ = tier_connector()
    tiers.start_load(KVLoadPart(request("a"), "tier", 0, 8, [4, 5], [1, 1], [b"k0", b"k1"]))
    tiers.on_events([KVEvent("loaded", 0, "a", num_pages=2), KVEvent("loaded", 1, "a", ok=False)])
    assert [r.num_tokens for r in tiers.poll()] == [0]


def test_a_cancelled_load_is_cancelled_on_the_ranks_and_late_answers_are_ignored():
    tiers, ops = tier_connector()
    tiers.start_load(KVLoadPart(request("a"), "tier", 0, 4, [4], [1], [b"k0"]))
    tiers.cancel("a")
    assert ops.take()[-1] == CancelLoad("a")
    tiers.on_events([KVEvent("loaded", 0, "a", num_pages=1), KVEvent("loaded", 1, "a", num_pages=1)])
    assert tiers.poll() == [] and not tiers.in_flight


def test_evictions_and_finished_requests_become_spills_and_saves():
    tiers, ops = tier_connector()
    tiers.on_evict(b"k9", 3)
    done = request("a")
    done.page_ids, done.page_keys, done.cached_page_count = [7, 8, 9], [b"k0", b"k1"], 2
    tiers.request_finished(done)
    assert ops.take() == [TierSpill(b"k9", 3), TierSave([b"k0", b"k1"], [7, 8])]


def test_prefill_pages_stay_held_until_every_rank_sent_its_shard():
    kv = KVCacheManager(16, PAGE)
    ops = KVOpQueue()
    peer = PeerKVConnector(ops, kv, 30.0, world_size=2)
    done = request("p", KVTransferParams("prefill", "t1", "tcp://a:1,tcp://a:2;tp2pp1"))
    assert kv.allocate_slots(done, 17)
    done.num_computed_tokens, done.finish_reason = 17, "length"
    peer.request_finished(done)
    (send,) = ops.take()
    assert isinstance(send, PeerSend) and send.num_tokens == 17 and send.page_ids == done.page_ids[:5]
    used = kv.num_used_pages
    kv.free(done)
    assert kv.num_used_pages == used  # held by the send
    peer.on_events([KVEvent("sent", 0, "p", "t1", num_pages=5)])
    assert peer.is_sending("p") and peer.poll_sent() == []
    peer.on_events([KVEvent("sent", 1, "p", "t1", ok=False, detail="connection refused")])
    assert peer.poll_sent() == [("p", False)] and not peer.is_sending("p")
    assert kv.num_used_pages == 0


def test_a_receive_is_done_when_every_rank_has_its_shard_and_one_failure_recomputes():
    kv = KVCacheManager(16, PAGE)
    ops = KVOpQueue()
    peer = PeerKVConnector(ops, kv, 30.0, world_size=2)
    for name in ("ok", "bad"):
        r = request(name, KVTransferParams("decode", f"t-{name}"))
        assert peer.request_added(r) == 16
        peer.start_load(KVLoadPart(r, "peer", 0, 16, [1, 2, 3, 4], [1] * 4))
    assert [type(op) for op in ops.take()] == [PeerReceive, PeerReceive]
    peer.on_events(
        [KVEvent("received", 0, "ok", "t-ok", num_pages=4), KVEvent("received", 0, "bad", "t-bad")]
    )
    assert peer.poll() == []
    peer.on_events([KVEvent("received", 1, "ok", "t-ok", num_pages=4)])
    peer.on_events([KVEvent("received", 1, "bad", "t-bad", ok=False, detail="checksum")])
    assert {r.request_id: r.num_tokens for r in peer.poll()} == {"ok": 16, "bad": 0}
    assert ops.take() == [PeerClose("t-bad")]  # rank 0 stops writing too
