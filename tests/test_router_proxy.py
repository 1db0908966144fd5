"""The router over real HTTP: pass-through, streaming, retries, failures, health, admin, metrics.

Fake workers (scripts/router_fake_worker.py) and the router run on real loopback sockets.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from hearth.router.app import Router
from hearth.router.config import RouterConfig
from hearth.router.workers import WorkerPool

_spec = importlib.util.spec_from_file_location(
    "router_fake_worker", Path(__file__).parent.parent / "scripts" / "router_fake_worker.py"
)
assert _spec is not None and _spec.loader is not None
fake = importlib.util.module_from_spec(_spec)
sys.modules["router_fake_worker"] = fake
_spec.loader.exec_module(fake)

pytestmark = pytest.mark.timeout(60)
ADMIN = {"authorization": "Bearer sesame"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}


class Cluster:
    def __init__(self) -> None:
        self.runners: list[web.AppRunner] = []
        self.workers: list[Any] = []
        self.urls: list[str] = []
        self.router: Router | None = None
        self.url = ""
        self.http: aiohttp.ClientSession | None = None

    async def add_worker(self, **kwargs: Any) -> tuple[Any, str]:
        worker = fake.FakeWorker(name=f"w{len(self.workers)}", **kwargs)
        runner, url = await fake.serve_app(worker.build_app())
        self.runners.append(runner)
        self.workers.append(worker)
        self.urls.append(url)
        return worker, url

    async def start_router(self, roles: dict[str, str] | None = None, **config: Any) -> None:
        pool = WorkerPool(prefix_blocks=1000)
        for url in self.urls:
            pool.add(url, (roles or {}).get(url, "mixed"))
        base = RouterConfig(admin_key="sesame", health_interval_s=0.2, health_timeout_s=1.0)
        self.router = Router(replace(base, **config), pool)
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
async def cluster() -> AsyncIterator[Cluster]:
    c = Cluster()
    yield c
    await c.close()


async def read_events(resp: aiohttp.ClientResponse) -> list[str]:
    text = (await resp.read()).decode()
    return [e for e in text.split("\n\n") if e.strip()]


async def test_non_streamed_chat_passes_through_with_forwarded_headers(cluster: Cluster) -> None:
    worker, _ = await cluster.add_worker()
    await cluster.start_router()
    assert cluster.http is not None
    headers = {"authorization": "Bearer user-key", "x-request-id": "req-1", "x-session-affinity": "s-1"}
    async with cluster.http.post(cluster.url + "/v1/chat/completions", json=CHAT, headers=headers) as resp:
        assert resp.status == 200
        body = await resp.json()
    assert body["choices"][0]["message"]["content"] == "tok0 tok1 tok2"
    assert worker.requests == [CHAT]
    seen = {k.lower(): v for k, v in worker.headers_seen[0].items()}
    assert (seen["authorization"], seen["x-request-id"], seen["x-session-affinity"]) == (
        "Bearer user-key",
        "req-1",
        "s-1",
    )


async def test_streams_pass_through_chunk_by_chunk(cluster: Cluster) -> None:
    gate = asyncio.Event()
    await cluster.add_worker(gate=gate)
    await cluster.start_router()
    assert cluster.http is not None
    body = {"prompt": "hi", "stream": True}
    async with cluster.http.post(cluster.url + "/v1/completions", json=body) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        # The worker holds the rest of its stream until the gate opens: a buffering router would hang here.
        first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5.0)
        assert b"tok0" in first
        gate.set()
        rest = (await resp.read()).decode()
    assert "tok1" in rest and rest.rstrip().endswith("data: [DONE]")


async def test_openai_client_streams_through_the_router(cluster: Cluster) -> None:

    await cluster.add_worker(num_chunks=4)
    await cluster.start_router()
    client = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="k", max_retries=0)
    stream = await client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "x"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    parts, usage = [], None
    async for chunk in stream:
        parts += [c.delta.content for c in chunk.choices if c.delta.content]
        usage = chunk.usage or usage
    assert "".join(parts) == "tok0 tok1 tok2 tok3 "
    assert usage is not None and usage.completion_tokens == 4
    models = await client.models.list()
    assert [m.id for m in models.data] == ["fake-model"]
    await client.close()


async def test_failure_before_first_byte_is_retried_once_on_another_worker(cluster: Cluster) -> None:
    broken, _ = await cluster.add_worker(fail="500")
    healthy, _ = await cluster.add_worker()
    await cluster.start_router(policy="round_robin")
    assert cluster.http is not None
    for _ in range(4):
        async with cluster.http.post(cluster.url + "/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 200
            assert (await resp.json())["worker"] == healthy.name
    # Round robin's turn lands on the broken worker first every time; each try is retried once.
    assert len(broken.requests) == 4
    metrics = await (await cluster.http.get(cluster.url + "/metrics")).text()
    assert "hearth_router_retries_total 4.0" in metrics
    assert f'hearth_router_errors_total{{kind="status_5xx",worker="{cluster.urls[0]}"}} 4.0' in metrics


async def test_all_workers_failing_gives_an_openai_error_not_a_crash(cluster: Cluster) -> None:
    await cluster.add_worker(fail="500")
    await cluster.add_worker(fail="500")
    await cluster.start_router()
    assert cluster.http is not None
    async with cluster.http.post(cluster.url + "/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 503
        error = (await resp.json())["error"]
    assert error["code"] == "no_worker" and "500" in error["message"]
    async with cluster.http.post(cluster.url + "/v1/chat/completions", data=b"{not json") as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["type"] == "invalid_request_error"


async def test_failure_mid_stream_ends_with_an_sse_error_event(cluster: Cluster) -> None:
    await cluster.add_worker(fail="midstream", num_chunks=5)
    await cluster.start_router()
    assert cluster.http is not None
    async with cluster.http.post(
        cluster.url + "/v1/completions", json={"prompt": "x", "stream": True}
    ) as resp:
        events = await asyncio.wait_for(read_events(resp), 10.0)
    assert "tok0" in events[0] and "tok1" in events[1]
    error = json.loads(events[-1].removeprefix("data: "))["error"]
    assert error["code"] == "upstream_error"
    metrics = await (await cluster.http.get(cluster.url + "/metrics")).text()
    assert 'kind="midstream"' in metrics


async def test_a_worker_that_goes_silent_mid_stream_does_not_hang_the_client(cluster: Cluster) -> None:

    await cluster.add_worker(fail="hang_midstream", num_chunks=5)
    await cluster.start_router(read_timeout_s=1.0)
    client = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="k", max_retries=0)
    started = time.monotonic()
    with pytest.raises(openai.APIError, match="mid-stream"):
        stream = await client.completions.create(model="m", prompt="x", stream=True)
        async for _ in stream:
            pass
    assert time.monotonic() - started < 5.0
    await client.close()


async def test_dead_worker_is_out_within_2s_and_back_when_it_answers(cluster: Cluster) -> None:
    sick, _ = await cluster.add_worker()
    well, _ = await cluster.add_worker()
    await cluster.start_router(policy="round_robin")
    assert cluster.http is not None and cluster.router is not None
    sick.fail = "refuse_health"
    started = time.monotonic()
    while cluster.router.pool.workers[cluster.urls[0]].healthy:
        assert time.monotonic() - started < 2.0
        await asyncio.sleep(0.05)
    for _ in range(3):
        async with cluster.http.post(cluster.url + "/v1/chat/completions", json=CHAT) as resp:
            assert (await resp.json())["worker"] == well.name
    sick.fail = None
    started = time.monotonic()
    while not cluster.router.pool.workers[cluster.urls[0]].healthy:
        assert time.monotonic() - started < 2.0
        await asyncio.sleep(0.05)
    names = set()
    for _ in range(2):
        async with cluster.http.post(cluster.url + "/v1/chat/completions", json=CHAT) as resp:
            names.add((await resp.json())["worker"])
    assert names == {sick.name, well.name}


async def test_a_killed_worker_costs_no_failed_request(cluster: Cluster) -> None:
    await cluster.add_worker()
    survivor, _ = await cluster.add_worker()
    await cluster.start_router(policy="round_robin", health_interval_s=30.0)
    assert cluster.http is not None
    await cluster.runners[0].cleanup()  # the process is gone: connections are refused
    for _ in range(4):
        async with cluster.http.post(cluster.url + "/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 200
            assert (await resp.json())["worker"] == survivor.name


async def test_admin_adds_and_removes_workers_behind_a_key(cluster: Cluster) -> None:
    await cluster.add_worker()
    await cluster.start_router()
    newcomer, new_url = await cluster.add_worker()
    assert cluster.http is not None
    admin = cluster.url + "/admin/workers"
    async with cluster.http.post(admin, json={"url": new_url}) as resp:
        assert resp.status == 401
    async with cluster.http.post(
        admin, json={"url": new_url}, headers={"authorization": "Bearer wrong"}
    ) as resp:
        assert resp.status == 401
    async with cluster.http.post(admin, json={"url": "ftp://x"}, headers=ADMIN) as resp:
        assert resp.status == 400 and "http://" in (await resp.json())["error"]["message"]
    async with cluster.http.post(admin, json={"url": new_url}, headers=ADMIN) as resp:
        assert resp.status == 201
    async with cluster.http.post(admin, json={"url": new_url}, headers=ADMIN) as resp:
        assert resp.status == 400  # already there
    async with cluster.http.delete(admin, params={"url": cluster.urls[0]}, headers=ADMIN) as resp:
        assert resp.status == 200
    async with cluster.http.get(admin, headers=ADMIN) as resp:
        assert [w["url"] for w in (await resp.json())["workers"]] == [new_url]
    async with cluster.http.post(cluster.url + "/v1/chat/completions", json=CHAT) as resp:
        assert (await resp.json())["worker"] == newcomer.name
    async with cluster.http.delete(admin, params={"url": "http://127.0.0.1:1"}, headers=ADMIN) as resp:
        assert resp.status == 404


async def test_admin_is_off_without_a_key(cluster: Cluster) -> None:
    await cluster.add_worker()
    await cluster.start_router(admin_key=None)
    assert cluster.http is not None
    async with cluster.http.get(cluster.url + "/admin/workers", headers=ADMIN) as resp:
        assert resp.status == 403


async def test_session_header_keeps_a_session_on_one_worker(cluster: Cluster) -> None:
    for _ in range(3):
        await cluster.add_worker()
    await cluster.start_router()
    assert cluster.http is not None
    by_session: dict[str, set[str]] = {}
    for _turn in range(3):
        for session in ("alpha", "beta", "gamma", "delta"):
            async with cluster.http.post(
                cluster.url + "/v1/chat/completions", json=CHAT, headers={"x-session-affinity": session}
            ) as resp:
                by_session.setdefault(session, set()).add((await resp.json())["worker"])
    assert all(len(names) == 1 for names in by_session.values())


async def test_repeated_prefix_returns_to_the_worker_that_holds_it(cluster: Cluster) -> None:
    for _ in range(3):
        await cluster.add_worker()
    await cluster.start_router(balance=replace(RouterConfig().balance, min_prefix_match_tokens=64))
    assert cluster.http is not None
    system = "You are a careful agent. " * 200
    placed: dict[int, set[str]] = {}
    for turn in range(3):
        for agent in range(3):
            messages = [{"role": "system", "content": f"agent {agent}: {system}"}]
            messages += [{"role": "user", "content": f"turn {t}"} for t in range(turn + 1)]
            async with cluster.http.post(
                cluster.url + "/v1/chat/completions", json={"messages": messages}
            ) as resp:
                placed.setdefault(agent, set()).add((await resp.json())["worker"])
    assert all(len(names) == 1 for names in placed.values())
    metrics = await (await cluster.http.get(cluster.url + "/metrics")).text()
    assert 'hearth_router_decisions_total{reason="prefix"} 6.0' in metrics


async def test_load_report_steers_traffic_away_from_a_busy_worker(cluster: Cluster) -> None:
    busy, _ = await cluster.add_worker(load_report={"prefill_tokens": 90000, "decode_tokens": 5000})
    idle, _ = await cluster.add_worker(load_report={"prefill_tokens": 0, "decode_tokens": 0})
    await cluster.add_worker()  # offers no report: 404
    await cluster.start_router(policy="token_aware")
    assert cluster.http is not None and cluster.router is not None
    await asyncio.sleep(0.5)
    pool = cluster.router.pool
    assert pool.workers[cluster.urls[0]].offers_load_report is True
    assert pool.workers[cluster.urls[2]].offers_load_report is False
    assert pool.workers[cluster.urls[0]].load.effective_prefill_tokens() == 90000
    for _ in range(6):
        async with cluster.http.post(cluster.url + "/v1/chat/completions", json=CHAT) as resp:
            assert (await resp.json())["worker"] != busy.name


async def test_metrics_report_requests_decisions_tokens_and_latency(cluster: Cluster) -> None:
    gate = asyncio.Event()
    await cluster.add_worker(gate=gate)
    await cluster.start_router()
    assert cluster.http is not None
    body = {"prompt": "x" * 4000, "stream": True}
    async with cluster.http.post(cluster.url + "/v1/completions", json=body) as resp:
        await resp.content.readuntil(b"\n\n")
        during = await (await cluster.http.get(cluster.url + "/metrics")).text()
        gate.set()
        await resp.read()
    after = await (await cluster.http.get(cluster.url + "/metrics")).text()
    worker = cluster.urls[0]
    assert f'hearth_router_inflight_decode_tokens{{worker="{worker}"}} 1000.0' in during
    assert f'hearth_router_inflight_decode_tokens{{worker="{worker}"}} 0.0' in after
    assert f'hearth_router_requests_total{{worker="{worker}"}} 1.0' in after
    assert 'hearth_router_decisions_total{reason="least_tokens"} 1.0' in after
    assert "hearth_router_added_latency_seconds_count 1.0" in after


async def test_with_a_tokenizer_the_prefix_index_uses_engine_page_keys(
    cluster: Cluster, tmp_path: Path
) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{i}" for i in range(200)]
    tokenizer = Tokenizer(
        models.WordLevel({"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}, unk_token="[UNK]")
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    for _ in range(2):
        await cluster.add_worker()
    await cluster.start_router(
        tokenizer_dir=str(tmp_path),
        page_size=4,
        balance=replace(RouterConfig().balance, min_prefix_match_tokens=8),
    )
    assert cluster.http is not None and cluster.router is not None
    prompt = " ".join(words[:40])
    placed = set()
    for i in range(3):
        async with cluster.http.post(
            cluster.url + "/v1/completions", json={"prompt": f"{prompt} w{i}"}
        ) as resp:
            placed.add((await resp.json())["worker"])
    assert len(placed) == 1
    holder = next(w for w in cluster.router.pool.workers.values() if len(w.prefix))
    # 41 tokens -> 10 full pages of 4 tokens; the trailing partial page has no key.
    assert len(holder.prefix) == 10


async def test_a_client_that_leaves_mid_stream_releases_its_load(cluster: Cluster) -> None:
    gate = asyncio.Event()
    await cluster.add_worker(gate=gate, num_chunks=50, delay_s=0.02)
    await cluster.start_router()
    assert cluster.http is not None and cluster.router is not None
    worker = cluster.router.pool.workers[cluster.urls[0]]
    resp = await cluster.http.post(
        cluster.url + "/v1/completions", json={"prompt": "x" * 400, "stream": True}
    )
    await resp.content.readuntil(b"\n\n")
    assert worker.load.requests == 1 and worker.load.decode_tokens == 100
    resp.close()  # the client goes away
    gate.set()
    deadline = time.monotonic() + 5.0
    while worker.load.requests:
        assert time.monotonic() < deadline, "the router kept a departed client's request in flight"
        await asyncio.sleep(0.05)
    assert worker.load.decode_tokens == 0 and worker.load.prefill_tokens == 0
    # ...and the router hung up on the worker, which is how a real server learns to abort.
    while not cluster.workers[0].streams_aborted:
        assert time.monotonic() < deadline, "the worker's stream was never cut off"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize(
    "header, body_extra",
    [
        ("x-claude-code-session-id", {}),
        ("session-id", {}),  # Codex
        ("x-session-id", {}),  # OpenCode
        (None, {"metadata": {"user_id": "user_ab12_account__session_{session}"}}),  # older Claude Code
        (None, {"prompt_cache_key": "{session}"}),  # OpenAI's own affinity hint
    ],
)
async def test_harness_session_ids_keep_a_session_on_one_worker(
    cluster: Cluster, header: str | None, body_extra: dict[str, Any]
) -> None:
    for _ in range(3):
        await cluster.add_worker()
    await cluster.start_router()
    assert cluster.http is not None
    by_session: dict[str, set[str]] = {}
    for _turn in range(3):
        # 12 sessions: the ring is keyed by the workers' (random) ports, and 4 sessions all landed on one of
        # 3 workers in ~1 of 30 runs; 12 do so about once in 180,000.
        for session in [f"0a1b2c3d-{i}" for i in range(1, 13)]:
            extra = json.loads(json.dumps(body_extra).replace("{session}", session))
            async with cluster.http.post(
                cluster.url + "/v1/chat/completions",
                json={**CHAT, **extra},
                headers={header: session} if header else {},
            ) as resp:
                by_session.setdefault(session, set()).add((await resp.json())["worker"])
    assert all(len(names) == 1 for names in by_session.values())
    assert len(set().union(*by_session.values())) > 1, "sessions spread over the workers"
