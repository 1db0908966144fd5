"""The KV load coordinator: splits loads into tier and peer parts, runs connectors, completes requests."""

from __future__ import annotations

from hearth.engine.kv_connector import KVConnector, KVLoadCoordinator, KVLoadPart, KVLoadResult
from hearth.engine.request import Request, RequestStatus
from hearth.engine.sampling_params import SamplingParams
from hearth.engine.scheduler import Scheduler
from hearth.kv.manager import KVCacheManager
from hearth.kv.prefix_keys import root_key

PAGE = 4


class Source(KVConnector):
    """Answers each started part when told to, with a chosen number of tokens."""

    def __init__(self, source: str) -> None:
        self.source = source  # type: ignore[assignment]
        self.parts: dict[str, KVLoadPart] = {}
        self.answers: list[KVLoadResult] = []
        self.cancelled: list[str] = []
        self.finished: list[str] = []

    def start_load(self, part: KVLoadPart) -> None:
        self.parts[part.request_id] = part

    def answer(self, request_id: str, num_tokens: int | None = None) -> None:
        part = self.parts.pop(request_id)
        tokens = part.num_tokens if num_tokens is None else num_tokens
        self.answers.append(KVLoadResult(request_id, self.source, tokens))  # type: ignore[arg-type]

    def poll(self) -> list[KVLoadResult]:
        answers, self.answers = self.answers, []
        return answers

    def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)
        self.parts.pop(request_id, None)

    def request_finished(self, request: Request) -> None:
        self.finished.append(request.request_id)


def setup(lookup_pages: int = 0, connectors: tuple[str, ...] = ("tier", "peer")):
    kv = KVCacheManager(64, PAGE, lookup=(lambda keys: min(len(keys), lookup_pages)))
    scheduler = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=8)
    sources = {name: Source(name) for name in connectors}
    return scheduler, sources, KVLoadCoordinator(scheduler, list(sources.values()), PAGE)


def request(index: int, num_tokens: int) -> Request:
    return Request(
        request_id=f"r{index}",
        prompt_token_ids=[index * 100 + i for i in range(num_tokens)],
        params=SamplingParams(max_tokens=4),
        prefix_root=root_key("m"),
        arrival_index=index,
        max_model_len=1000,
    )


def admit(scheduler: Scheduler, coordinator: KVLoadCoordinator, req: Request, remote: int) -> None:
    scheduler.add(req, kv_pending_tokens=remote)
    coordinator.start(scheduler.schedule().kv_loads)
    assert req.status is RequestStatus.WAITING_FOR_KV


def test_load_splits_into_tier_pages_then_peer_tokens_and_completes_when_both_answer() -> None:
    scheduler, sources, coordinator = setup(lookup_pages=2)
    req = request(0, 18)
    admit(scheduler, coordinator, req, remote=18)
    tier, peer = sources["tier"].parts["r0"], sources["peer"].parts["r0"]
    assert (tier.start_token, tier.num_tokens, len(tier.keys)) == (0, 8, 2)
    assert tier.page_ids == req.page_ids[:2]
    assert (peer.start_token, peer.num_tokens, peer.keys) == (8, 9, [])
    assert peer.page_ids == req.page_ids[2:]
    sources["peer"].answer("r0")
    coordinator.poll()
    assert req.status is RequestStatus.WAITING_FOR_KV  # the tier has not answered yet
    sources["tier"].answer("r0")
    coordinator.poll()
    assert req.status is RequestStatus.RUNNING and req.num_computed_tokens == 17
    assert req.cached_tokens == 8  # tier tokens are cache hits, the peer's are not
    assert req.cached_tokens_by_source == (0, 8, 0, 9)
    assert coordinator.num_pending == 0


def test_tier_tokens_a_shared_store_served_are_counted_apart() -> None:
    scheduler, sources, coordinator = setup(lookup_pages=3)
    req = request(0, 18)
    admit(scheduler, coordinator, req, remote=18)
    sources["tier"].parts.pop("r0")
    sources["tier"].answers.append(KVLoadResult("r0", "tier", 12, num_store_tokens=8))
    sources["peer"].answer("r0")
    coordinator.poll()
    assert req.cached_tokens == 12 and req.cached_tokens_by_source == (0, 4, 8, 5)


def test_store_tokens_past_a_short_tier_answer_are_not_counted() -> None:
    scheduler, sources, coordinator = setup(lookup_pages=3)
    req = request(0, 18)
    admit(scheduler, coordinator, req, remote=0)
    sources["tier"].parts.pop("r0")
    # A connector that claims more store tokens than arrived cannot inflate usage.
    sources["tier"].answers.append(KVLoadResult("r0", "tier", 4, num_store_tokens=12))
    coordinator.poll()
    assert req.cached_tokens == 4 and req.cached_tokens_by_source == (0, 0, 4, 0)


def test_short_tier_answer_makes_the_peer_pages_useless_and_the_rest_is_recomputed() -> None:
    scheduler, sources, coordinator = setup(lookup_pages=2)
    req = request(0, 18)
    admit(scheduler, coordinator, req, remote=18)
    sources["tier"].answer("r0", 4)
    sources["peer"].answer("r0")
    coordinator.poll()
    assert req.num_computed_tokens == 4 and scheduler.num_kv_recomputed_tokens == 13


def test_failed_peer_and_missing_connector_mean_recompute() -> None:
    scheduler, sources, coordinator = setup(connectors=("peer",))
    req = request(0, 10)
    admit(scheduler, coordinator, req, remote=10)
    sources["peer"].answer("r0", 0)
    coordinator.poll()
    assert req.status is RequestStatus.RUNNING and req.num_computed_tokens == 0
    assert scheduler.num_kv_load_failures == 1

    scheduler, _, coordinator = setup(lookup_pages=2, connectors=())
    req = request(1, 18)
    scheduler.add(req)
    coordinator.start(scheduler.schedule().kv_loads)  # nobody serves the tier part
    assert req.status is RequestStatus.RUNNING and req.num_computed_tokens == 0


def test_finished_request_cancels_its_load_and_late_answers_are_ignored() -> None:
    scheduler, sources, coordinator = setup()
    req = request(0, 10)
    admit(scheduler, coordinator, req, remote=10)
    sources["peer"].answers.append(KVLoadResult("r0", "peer", 9))  # already on its way
    coordinator.request_finished(req)
    scheduler.finish(req)
    assert sources["peer"].cancelled == ["r0"] and sources["tier"].cancelled == ["r0"]
    assert sources["peer"].finished == ["r0"]
    coordinator.poll()
    assert req.status is RequestStatus.FINISHED and scheduler.kv.num_used_pages == 0
