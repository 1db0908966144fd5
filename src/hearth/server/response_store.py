"""Stored responses for `previous_response_id` and `GET/DELETE /v1/responses/{id}`: bounded in count,
expiring, and scoped to the tenant that created them (another API key never sees them)."""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def tenant_of(authorization: str | None) -> str:
    """A tenant key from the request's credentials (a hash: the key itself is never kept)."""
    return hashlib.sha256((authorization or "").encode()).hexdigest()[:32]


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the Response object as returned
    messages: list[dict[str, Any]]  # the conversation through this response's output, as chat messages
    expires_s: float
    session: str | None = None  # the agent session the conversation is (its pages are retained between turns)


class ResponseStore:
    def __init__(
        self, max_responses: int = 4096, ttl_s: float = 3600.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_responses = max_responses
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[tuple[str, str], StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(
        self,
        tenant: str,
        response: dict[str, Any],
        messages: list[dict[str, Any]],
        session: str | None = None,
    ) -> None:
        self._expire()
        key = (tenant, response["id"])
        self._entries[key] = StoredResponse(response, messages, self._clock() + self.ttl_s, session)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_responses:
            self._entries.popitem(last=False)  # the least recently used goes first

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        self._expire()
        entry = self._entries.get((tenant, response_id))
        if entry is not None:
            self._entries.move_to_end((tenant, response_id))
        return entry

    def delete(self, tenant: str, response_id: str) -> bool:
        return self._entries.pop((tenant, response_id), None) is not None

    def _expire(self) -> None:
        now = self._clock()
        expired = [key for key, entry in self._entries.items() if entry.expires_s <= now]
        for key in expired:
            del self._entries[key]
