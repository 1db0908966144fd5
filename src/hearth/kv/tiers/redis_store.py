"""Redis (or Valkey) as the cluster-shared tier: `--kv-store redis://host:port[/db][?timeout_ms=N]`.

One value per page (`hearth:kv:<key hex>`, an encoded blob). Every server of the cluster points at
the same Redis, so a prefix one server computed is found by all. Redis decides what to forget: run it
with `maxmemory` and `maxmemory-policy allkeys-lru`. Lookups are one pipelined round trip of EXISTS
with a short timeout (they run on the engine thread); loads and writes run on the stack's threads with
a longer one. Any connection error or timeout is `TierUnavailable`.
"""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import parse_qs, urlsplit

import redis

from hearth.kv.tiers.base import BlobStoreTier, TierUnavailable
from hearth.kv.tiers.page_format import PageSpec

DEFAULT_LOOKUP_TIMEOUT_S = 0.05
DEFAULT_TIMEOUT_S = 1.0


class RedisTier(BlobStoreTier):
    name = "redis"

    def __init__(self, spec: PageSpec, url: str) -> None:
        super().__init__(spec)
        parts = urlsplit(url)
        query = parse_qs(parts.query)
        timeout_s = float(query.get("timeout_ms", [DEFAULT_TIMEOUT_S * 1000])[0]) / 1000
        lookup_timeout_s = float(query.get("lookup_timeout_ms", [DEFAULT_LOOKUP_TIMEOUT_S * 1000])[0]) / 1000
        base = parts._replace(query="").geturl()
        self.url = base
        # Two pools: the engine thread's lookups must not wait behind a large load on a shared socket.
        self._lookup_client = redis.Redis.from_url(
            base, socket_timeout=lookup_timeout_s, socket_connect_timeout=lookup_timeout_s
        )
        self._client = redis.Redis.from_url(base, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)

    @staticmethod
    def _call(fn, *args):  # noqa: ANN001, ANN205 - a thin error translation
        try:
            return fn(*args)
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            raise TierUnavailable(f"redis: {exc}") from exc

    def _exists(self, names: list[str]) -> list[bool]:
        def run() -> list[bool]:
            pipe = self._lookup_client.pipeline(transaction=False)
            for name in names:
                pipe.exists(name)
            return [bool(n) for n in pipe.execute()]

        return self._call(run) if names else []

    def _get(self, names: list[str]) -> list[bytes | None]:
        return self._call(self._client.mget, names) if names else []

    def _put(self, pairs: Sequence[tuple[str, bytes]]) -> None:
        def run() -> None:
            pipe = self._client.pipeline(transaction=False)
            for name, blob in pairs:
                pipe.set(name, blob)
            pipe.execute()

        if pairs:
            self._call(run)

    def close(self) -> None:
        self._lookup_client.close()
        self._client.close()
