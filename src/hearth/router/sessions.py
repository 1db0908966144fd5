"""Sessions at the router: requests of one session (`hearth.server.sessions.session_key`: harness headers,
`metadata.user_id`, `prompt_cache_key`) go to the same worker while it is not overloaded, so each turn finds
the previous turns' KV there. A Responses follow-up
(`previous_response_id`) must go to the worker that stored the response it continues: `ResponseOwners`
remembers that from the answers passing through.
"""

from __future__ import annotations

import re
from collections import OrderedDict

from hearth.server.sessions import SESSION_HEADERS, session_key

__all__ = ["SESSION_HEADERS", "ResponseOwners", "response_id_in", "session_key"]


class ResponseOwners:
    """Response id -> the URL of the worker that answered it, for the most recent `max_ids` responses."""

    def __init__(self, max_ids: int = 65536) -> None:
        self.max_ids = max_ids
        self._owners: OrderedDict[str, str] = OrderedDict()

    def remember(self, response_id: str, worker_url: str) -> None:
        self._owners[response_id] = worker_url
        self._owners.move_to_end(response_id)
        while len(self._owners) > self.max_ids:
            self._owners.popitem(last=False)

    def owner(self, response_id: str) -> str | None:
        return self._owners.get(response_id)

    def forget(self, response_id: str) -> None:
        self._owners.pop(response_id, None)


_RESPONSE_ID = re.compile(rb'"id":\s*"(resp_[A-Za-z0-9_-]{1,128})"')


def response_id_in(data: bytes) -> str | None:
    """The first Responses id in an answer's bytes (a JSON body, or the `response.created` event)."""
    match = _RESPONSE_ID.search(data)
    return match.group(1).decode() if match else None
