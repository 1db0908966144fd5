"""PD mode: each protocol adapter against fake workers that speak it, over real HTTP.

The decode side reports its own cached_tokens (0); the prefill side's (42) must reach the
client, in the JSON body and in the final SSE chunk.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from hearth.router.app import Router
from hearth.router.config import RouterConfig
from hearth.router.pd import PD_ADAPTERS, PDPair, make_pd_adapter
from hearth.router.workers import Worker, WorkerPool

_spec = importlib.util.spec_from_file_location(
    "router_fake_worker", Path(__file__).parent.parent / "scripts" / "router_fake_worker.py"
)
assert _spec is not None and _spec.loader is not None
fake = importlib.util.module_from_spec(_spec)
sys.modules["router_fake_worker"] = fake
_spec.loader.exec_module(fake)

pytestmark = pytest.mark.timeout(60)
CHAT = {"model": "m", "messages": [{"role": "user", "content": "plan the trip"}], "max_tokens": 50}
PREFILL_CACHED = 42


class PDCluster:
    def __init__(self) -> None:
        self.runners: list[web.AppRunner] = []
        self.prefills: list[Any] = []
        self.decodes: list[Any] = []
        self.rendezvous = fake.Rendezvous()
        self.url = ""
        self.router: Router | None = None
        self.http: aiohttp.ClientSession | None = None

    async def start(
        self, protocol: str, decode_fail: list[str | None] | None = None, num_prefill: int = 1
    ) -> None:
        pool = WorkerPool()
        for i in range(num_prefill):
            worker = fake.FakeWorker(
                name=f"p{i}",
                role="prefill",
                protocol=protocol,
                cached_tokens=PREFILL_CACHED,
                rendezvous=self.rendezvous,
            )
            runner, url = await fake.serve_app(worker.build_app())
            self.runners.append(runner)
            self.prefills.append(worker)
            pool.add(url, "prefill", bootstrap_port=8998 + i)
        for i, fail in enumerate(decode_fail or [None]):
            worker = fake.FakeWorker(
                name=f"d{i}",
                role="decode",
                protocol=protocol,
                cached_tokens=0,
                rendezvous=self.rendezvous,
                fail=fail,
            )
            runner, url = await fake.serve_app(worker.build_app())
            self.runners.append(runner)
            self.decodes.append(worker)
            pool.add(url, "decode")
        config = replace(RouterConfig(), pd_protocol=protocol, policy="round_robin", health_interval_s=0.5)
        self.router = Router(config, pool)
        self.url = f"http://127.0.0.1:{await self.router.serve('127.0.0.1', 0)}"
        self.http = aiohttp.ClientSession()

    async def close(self) -> None:
        if self.http is not None:
            await self.http.close()
        if self.router is not None:
            await self.router.close()
        for runner in reversed(self.runners):
            await runner.cleanup()


@pytest.fixture
async def pd() -> AsyncIterator[PDCluster]:
    cluster = PDCluster()
    yield cluster
    await cluster.close()


@pytest.mark.parametrize("protocol", sorted(PD_ADAPTERS))
async def test_json_answer_comes_from_decode_with_the_prefill_sides_cached_tokens(
    pd: PDCluster, protocol: str
) -> None:
    await pd.start(protocol)
    assert pd.http is not None
    async with pd.http.post(pd.url + "/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 200, await resp.text()
        body = await resp.json()
    assert body["worker"] == "d0"
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == PREFILL_CACHED
    assert len(pd.prefills[0].requests) == 1 and len(pd.decodes[0].requests) == 1


@pytest.mark.parametrize("protocol", sorted(PD_ADAPTERS))
async def test_streamed_answer_rewrites_usage_in_the_final_chunk(pd: PDCluster, protocol: str) -> None:
    await pd.start(protocol)
    assert pd.http is not None
    body = dict(CHAT, stream=True, stream_options={"include_usage": True})
    async with pd.http.post(pd.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        text = (await resp.read()).decode()
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e.strip()]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks if c["choices"]) == "tok0 tok1 tok2 "
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == PREFILL_CACHED
    assert chunks[-1]["usage"]["completion_tokens"] == 3


async def test_hearth_protocol_bodies_name_each_other_and_share_a_transfer_id(pd: PDCluster) -> None:
    await pd.start("hearth")
    assert pd.http is not None
    async with pd.http.post(pd.url + "/v1/chat/completions", json=dict(CHAT, stream=True)) as resp:
        await resp.read()
    prefill_body, decode_body = pd.prefills[0].requests[0], pd.decodes[0].requests[0]
    assert prefill_body["kv_transfer"]["role"] == "prefill" and decode_body["kv_transfer"]["role"] == "decode"
    assert prefill_body["kv_transfer"]["transfer_id"] == decode_body["kv_transfer"]["transfer_id"]
    assert prefill_body["max_tokens"] == 1 and prefill_body["stream"] is False
    assert decode_body["max_tokens"] == 50 and decode_body["stream"] is True
    assert decode_body["messages"] == prefill_body["messages"] == CHAT["messages"]
    # Both sides see the same request id, so their logs line up.
    seen = [{k.lower(): v for k, v in w.headers_seen[0].items()} for w in (pd.prefills[0], pd.decodes[0])]
    assert seen[0]["x-request-id"] == seen[1]["x-request-id"] != ""


async def test_decode_failure_before_first_byte_is_retried_on_another_pair(pd: PDCluster) -> None:
    await pd.start("vllm", decode_fail=["500", None], num_prefill=2)
    assert pd.http is not None
    async with pd.http.post(pd.url + "/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 200
        body = await resp.json()
    assert body["worker"] == "d1"
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == PREFILL_CACHED


def _pair() -> PDPair:
    return PDPair(
        Worker("http://10.0.0.1:30000", "prefill", bootstrap_port=8998),
        Worker("http://10.0.0.2:30000", "decode"),
    )


def test_adapters_never_mutate_the_clients_body() -> None:
    for name in PD_ADAPTERS:
        adapter = make_pd_adapter(name)
        body = json.loads(json.dumps(dict(CHAT, stream=True, stream_options={"include_usage": True})))
        snapshot = json.dumps(body, sort_keys=True)
        adapter.prefill_body(body, _pair())
        adapter.decode_body(body, _pair(), {"kv_transfer_params": {"x": 1}})
        assert json.dumps(body, sort_keys=True) == snapshot, name


def test_sglang_adapter_sends_the_same_bootstrap_fields_to_both_sides() -> None:
    adapter, pair = make_pd_adapter("sglang"), _pair()
    prefill = adapter.prefill_body(CHAT, pair)
    decode = adapter.decode_body(CHAT, pair, None)
    assert prefill == decode
    assert (prefill["bootstrap_host"], prefill["bootstrap_port"]) == ("10.0.0.1", 8998)
    assert 0 <= prefill["bootstrap_room"] < 2**63
    assert not adapter.sequential


def test_vllm_adapter_is_sequential_and_hands_over_kv_transfer_params() -> None:
    adapter, pair = make_pd_adapter("vllm"), _pair()
    assert adapter.sequential
    prefill = adapter.prefill_body(dict(CHAT, max_completion_tokens=9, stream=True), pair)
    assert prefill["kv_transfer_params"]["do_remote_decode"] is True
    assert (prefill["max_tokens"], prefill["max_completion_tokens"], prefill["stream"]) == (1, 1, False)
    decode = adapter.decode_body(CHAT, pair, {"kv_transfer_params": {"remote_block_ids": [1]}})
    assert decode["kv_transfer_params"] == {"remote_block_ids": [1]}
    with pytest.raises(ValueError, match="unknown PD protocol"):
        make_pd_adapter("mooncake-magic")


def test_hearth_instructions_are_signed_for_the_peer_the_router_chose() -> None:
    """The servers follow only signed instructions (hearth.kv_transfer.auth): each side's signature
    names the transfer and the other side of the pair, so a client cannot redirect either."""
    from hearth.kv_transfer.auth import instruction_refusal

    secret = b"deployment"
    adapter, pair = make_pd_adapter("hearth", secret), _pair()
    prefill = adapter.prefill_body(CHAT, pair)["kv_transfer"]
    decode = adapter.decode_body(CHAT, pair, None)["kv_transfer"]
    assert (
        instruction_refusal(
            secret, "prefill", pair.transfer_id, pair.decode.url, prefill["expires"], prefill["signature"]
        )
        is None
    )
    assert (
        instruction_refusal(
            secret, "decode", pair.transfer_id, pair.prefill.url, decode["expires"], decode["signature"]
        )
        is None
    )
    assert instruction_refusal(
        secret, "prefill", pair.transfer_id, "http://elsewhere:1", prefill["expires"], prefill["signature"]
    )
    assert "signature" not in make_pd_adapter("hearth").prefill_body(CHAT, pair)["kv_transfer"]


async def test_a_stopped_prefill_holds_a_finished_answer_briefly_and_an_unhealthy_one_not_at_all() -> None:
    """Issue 30: finished answers waited up to 30 s for a stopped prefill server's usage."""
    import asyncio
    import time

    assert RouterConfig().prefill_usage_wait_s <= 2.0
    router = Router(replace(RouterConfig(), prefill_usage_wait_s=0.5), WorkerPool())
    worker = Worker("http://127.0.0.1:1", "prefill")
    never: asyncio.Task[dict[str, Any] | None] = asyncio.create_task(asyncio.sleep(3600))  # type: ignore[arg-type]
    try:
        started = time.monotonic()
        assert await router._prefill_cached_tokens(never, worker) is None
        assert 0.4 < time.monotonic() - started < 1.5
        worker.healthy = False  # the health checker saw it stop
        started = time.monotonic()
        assert await router._prefill_cached_tokens(never, worker) is None
        assert time.monotonic() - started < 0.05
    finally:
        never.cancel()

    async def answered() -> dict[str, Any]:
        return {"usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 7}}}

    worker.healthy = True
    assert await router._prefill_cached_tokens(asyncio.create_task(answered()), worker) == (7, None)
    await router.close()
