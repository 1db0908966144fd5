"""`--session-retention-s` through the server: a turn of a named session (harness header, Anthropic
metadata.user_id, a Responses chain) leaves its pages held, visible in /metrics; anonymous requests do not."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import pytest

from hearth.server.process import ServerProcess

MESSAGES = [{"role": "user", "content": "What's the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("retention")
    args = ["--kv-cache-memory", "0.05", "--max-model-len", "2048", "--session-retention-s", "600"]
    with ServerProcess(args, root / "server.log") as process:
        yield process


def _metric(server: ServerProcess, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    match = re.search(rf"^hearth_{name}\{{[^}}]*\}} ([0-9.e+]+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def _chat(server: ServerProcess, headers: dict[str, str]) -> None:
    body = {"messages": MESSAGES, "max_tokens": 4, "temperature": 0}
    response = httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert response.status_code == 200, response.text


def test_anonymous_requests_hold_nothing(server: ServerProcess) -> None:
    _chat(server, {})
    assert _metric(server, "kv_retained_sessions") == 0 and _metric(server, "kv_retained_pages") == 0


def test_each_harness_session_is_held_once_and_replaced_by_its_next_turn(server: ServerProcess) -> None:
    before = _metric(server, "kv_retained_sessions")
    _chat(server, {"x-claude-code-session-id": "c-1"})
    _chat(server, {"x-session-id": "o-1"})
    assert _metric(server, "kv_retained_sessions") == before + 2
    assert _metric(server, "kv_retained_pages") > 0
    _chat(server, {"x-session-id": "o-1"})  # the next turn of the same session
    assert _metric(server, "kv_retained_sessions") == before + 2
    assert _metric(server, "kv_retention_replaced_total") >= 1


def test_a_responses_chain_and_a_messages_user_are_sessions(server: ServerProcess) -> None:
    before = _metric(server, "kv_retained_sessions")
    first = httpx.post(
        server.url + "/v1/responses", json={"input": "Hello!", "max_output_tokens": 4}, timeout=60
    ).json()
    httpx.post(
        server.url + "/v1/responses",
        json={"input": "And again?", "previous_response_id": first["id"], "max_output_tokens": 4},
        timeout=60,
    ).raise_for_status()
    assert _metric(server, "kv_retained_sessions") == before + 1  # one chain, one session
    body = {
        "model": "demo",
        "max_tokens": 4,
        "messages": MESSAGES,
        "metadata": {"user_id": "user_x_account__session_abc-123"},
    }
    httpx.post(server.url + "/v1/messages", json=body, timeout=60).raise_for_status()
    assert _metric(server, "kv_retained_sessions") == before + 2


def test_anthropic_cache_control_marks_a_prefix_to_retain(server: ServerProcess) -> None:
    before = _metric(server, "kv_retained_sessions")
    system = [{"type": "text", "text": "You are a weather bot.", "cache_control": {"type": "ephemeral"}}]
    body = {"model": "demo", "max_tokens": 4, "messages": MESSAGES, "system": system}
    for _ in range(2):  # the same cached prefix: one session
        httpx.post(server.url + "/v1/messages", json=body, timeout=60).raise_for_status()
    assert _metric(server, "kv_retained_sessions") == before + 1
    unmarked = {**body, "system": "You are a weather bot."}
    httpx.post(server.url + "/v1/messages", json=unmarked, timeout=60).raise_for_status()
    assert _metric(server, "kv_retained_sessions") == before + 1
