"""The Responses store: tenant-scoped, bounded, expiring."""

from __future__ import annotations

from hearth.server.response_store import ResponseStore, tenant_of


def _response(response_id: str) -> dict:
    return {"id": response_id, "object": "response"}


def test_another_tenant_never_sees_a_stored_response() -> None:
    store = ResponseStore()
    alice, bob = tenant_of("Bearer alice"), tenant_of("Bearer bob")
    store.put(alice, _response("resp_1"), [{"role": "user", "content": "hi"}])
    assert store.get(alice, "resp_1") is not None
    assert store.get(bob, "resp_1") is None
    assert not store.delete(bob, "resp_1")
    assert store.delete(alice, "resp_1") and store.get(alice, "resp_1") is None


def test_the_least_recently_used_response_goes_when_full() -> None:
    store = ResponseStore(max_responses=2)
    for name in ("a", "b"):
        store.put("t", _response(name), [])
    assert store.get("t", "a") is not None  # a is now more recent than b
    store.put("t", _response("c"), [])
    assert len(store) == 2
    assert store.get("t", "b") is None and store.get("t", "a") is not None


def test_responses_expire_after_their_ttl() -> None:
    now = [0.0]
    store = ResponseStore(ttl_s=10.0, clock=lambda: now[0])
    store.put("t", _response("a"), [])
    now[0] = 9.9
    assert store.get("t", "a") is not None
    now[0] = 10.0
    assert store.get("t", "a") is None and len(store) == 0


def test_the_tenant_key_does_not_keep_the_credential() -> None:
    assert "secret" not in tenant_of("Bearer secret")
    assert tenant_of("Bearer a") != tenant_of("Bearer b")
