"""Session keys from harness headers and bodies; the owners of stored Responses."""

from __future__ import annotations

import json

from hearth.router.sessions import ResponseOwners, response_id_in, session_key


def test_headers_win_in_order_of_precedence() -> None:
    headers = {"x-session-id": "opencode", "session-id": "codex", "x-claude-code-session-id": "claude"}
    assert session_key(headers, {}) == "h:claude"
    assert session_key({**headers, "x-session-affinity": "explicit"}, {}) == "h:explicit"
    assert session_key({"session_id": "codex-old"}, {}) == "h:codex-old"


def test_claude_codes_metadata_user_id_gives_its_session_in_both_formats() -> None:
    new = {"metadata": {"user_id": json.dumps({"device_id": "d", "account_uuid": "", "session_id": "s-1"})}}
    old = {"metadata": {"user_id": "user_abc_account__session_57a121ec-f78c-48c3-a745-e3036a3ecc33"}}
    assert session_key({}, new) == "u:s-1"
    assert session_key({}, old) == "u:57a121ec-f78c-48c3-a745-e3036a3ecc33"
    assert session_key({}, {"metadata": {"user_id": "plain-user"}}) == "u:plain-user"


def test_prompt_cache_key_is_a_session_and_nothing_else_is() -> None:
    assert session_key({}, {"prompt_cache_key": "k"}) == "p:k"
    assert session_key({"authorization": "Bearer x"}, {"user": "u", "messages": []}) is None


def test_sources_never_collide() -> None:
    assert session_key({"x-session-id": "same"}, {}) != session_key({}, {"prompt_cache_key": "same"})


def test_response_owners_remember_the_most_recent() -> None:
    owners = ResponseOwners(max_ids=2)
    owners.remember("resp_a", "http://w1")
    owners.remember("resp_b", "http://w2")
    owners.remember("resp_c", "http://w1")
    assert owners.owner("resp_a") is None and owners.owner("resp_c") == "http://w1"
    owners.forget("resp_c")
    assert owners.owner("resp_c") is None


def test_the_response_id_is_found_in_a_body_and_in_the_first_event() -> None:
    assert response_id_in(b'{"id":"resp_abc123","object":"response"}') == "resp_abc123"
    event = b'event: response.created\ndata: {"type":"response.created","response":{"id": "resp_x9"}}\n\n'
    assert response_id_in(event) == "resp_x9"
    assert response_id_in(b'{"id":"chatcmpl-1"}') is None
