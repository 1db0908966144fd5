"""The bench client against a real HTTP server with known delays (hearth.bench.fake_server)."""

from __future__ import annotations

import socket

import aiohttp
import pytest

from hearth.bench.client import CHAT, COMPLETIONS, ClientOptions, RequestSpec, send_request
from hearth.bench.fake_server import STATE_KEY, FakeServerConfig, start_fake_server
from hearth.bench.metrics import summarize

TTFT_S = 0.15
ITL_S = 0.04


@pytest.fixture
async def server():
    config = FakeServerConfig(ttft_s=TTFT_S, itl_s=ITL_S)
    runner, url = await start_fake_server(config)
    yield url, runner.app[STATE_KEY]
    await runner.cleanup()


async def _send(url: str, spec: RequestSpec, **options) -> object:
    async with aiohttp.ClientSession() as session:
        return await send_request(session, spec, ClientOptions(base_url=url, model="m", **options))


async def test_ttft_and_inter_token_latencies_match_injected_delays(server):
    url, _ = server
    result = await _send(url, RequestSpec(endpoint=COMPLETIONS, max_tokens=6, prompt="a b c d"))
    assert result.success, result.error
    assert TTFT_S <= result.ttft_s < TTFT_S + 0.08
    assert len(result.itl_s) == 5
    for itl_s in result.itl_s:
        assert ITL_S * 0.8 <= itl_s < ITL_S + 0.05
    assert result.e2el_s == pytest.approx(TTFT_S + 5 * ITL_S, abs=0.12)
    assert result.tpot_s == pytest.approx(ITL_S, abs=0.02)
    assert result.generated_text == " w0 w1 w2 w3 w4 w5"


async def test_usage_is_parsed_including_cached_tokens(server):
    url, state = server
    prompt = " ".join(f"x{i}" for i in range(40))  # 2 full pages of 16 words + 8
    first = await _send(url, RequestSpec(endpoint=COMPLETIONS, max_tokens=2, prompt=prompt))
    second = await _send(url, RequestSpec(endpoint=COMPLETIONS, max_tokens=3, prompt=prompt + " more"))
    assert first.usage_reported and second.usage_reported
    assert (first.prompt_tokens, first.cached_tokens, first.completion_tokens) == (40, 0, 2)
    assert (second.prompt_tokens, second.cached_tokens, second.completion_tokens) == (41, 32, 3)
    body = state.requests[0]["body"]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}


async def test_chat_endpoint_streams_deltas_and_token_id_prompts_work(server):
    url, state = server
    chat = await _send(
        url, RequestSpec(endpoint=CHAT, max_tokens=3, messages=[{"role": "user", "content": "hi there"}])
    )
    ids = await _send(url, RequestSpec(endpoint=COMPLETIONS, max_tokens=1, prompt=[5, 6, 7]))
    assert chat.success and chat.generated_text == " w0 w1 w2" and chat.completion_tokens == 3
    assert ids.success and ids.prompt_tokens == 3
    assert state.requests[0]["path"] == "/v1/chat/completions"
    assert state.requests[1]["body"]["prompt"] == [5, 6, 7]


async def test_http_errors_and_cut_streams_are_failures_not_exceptions():
    runner, url = await start_fake_server(FakeServerConfig(fail_every=2, drop_every=3))
    try:
        results = [
            await _send(url, RequestSpec(endpoint=COMPLETIONS, max_tokens=5, prompt="p")) for _ in range(4)
        ]
    finally:
        await runner.cleanup()
    assert [r.success for r in results] == [True, False, False, False]
    assert results[1].error.startswith("HTTP 500") and "injected failure 2" in results[1].error
    assert results[2].error == "stream ended before [DONE]"
    summary = summarize(results, duration_s=1.0)
    assert summary["completed"] == 1 and summary["failed"] == 3
    assert summary["error_counts"]["HTTP 500"] == 2


async def test_unreachable_server_is_a_failure():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound but not listening: connections are refused
        result = await _send(
            f"http://127.0.0.1:{port}", RequestSpec(endpoint=COMPLETIONS, max_tokens=1, prompt="p")
        )
    assert not result.success
    assert "Connect" in result.error


async def test_request_timeout_is_a_failure():
    runner, url = await start_fake_server(FakeServerConfig(ttft_s=2.0))
    try:
        result = await _send(
            url, RequestSpec(endpoint=COMPLETIONS, max_tokens=1, prompt="p"), request_timeout_s=0.2
        )
    finally:
        await runner.cleanup()
    assert not result.success and "Timeout" in result.error


async def test_streamed_tool_call_fragments_are_merged():
    from hearth.bench.client import _merge_tool_call_deltas

    calls: list[dict] = []
    _merge_tool_call_deltas(
        calls, [{"index": 0, "id": "c1", "function": {"name": "get", "arguments": '{"a"'}}]
    )
    _merge_tool_call_deltas(calls, [{"index": 0, "function": {"arguments": ": 1}"}}])
    assert calls == [{"id": "c1", "type": "function", "function": {"name": "get", "arguments": '{"a": 1}'}}]
