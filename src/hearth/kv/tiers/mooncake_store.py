"""Mooncake Store as the cluster-shared tier: `--kv-store mooncake://MASTER_HOST:PORT?metadata=URL&...`.

Query options: `metadata` (the transfer engine's metadata server, e.g. `http://h:8080/metadata`, or
`P2PHANDSHAKE`), `local` (this node's address as other nodes reach it; default: the host name),
`protocol` (`tcp` or `rdma`, default tcp), `device` (RDMA device names), `segment_mb` (memory this
node lends the store, default 512), `buffer_mb` (its local transfer buffer, default 128).

From the `mooncake-transfer-engine(-non-cuda)` package (`mooncake.store`), imported only when used.
The transfer engine refuses to start without a non-loopback network interface.
"""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import parse_qs, urlsplit

from hearth.kv.tiers.base import BlobStoreTier, TierUnavailable
from hearth.kv.tiers.page_format import PageSpec

MB = 1 << 20


class MooncakeTier(BlobStoreTier):
    name = "mooncake"

    def __init__(self, spec: PageSpec, url: str) -> None:
        super().__init__(spec, prefix="hearth-kv-")
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise RuntimeError(
                f"--kv-store {url}: Mooncake Store is not importable ({exc}); "
                "pip install mooncake-transfer-engine-non-cuda (and apt-get install libibverbs1)"
            ) from exc
        parts = urlsplit(url)
        query = {name: values[0] for name, values in parse_qs(parts.query).items()}
        import socket

        local = query.get("local", socket.gethostname())
        self._store = MooncakeDistributedStore()
        rc = self._store.setup(
            local,
            query.get("metadata", "P2PHANDSHAKE"),
            int(float(query.get("segment_mb", 512)) * MB),
            int(float(query.get("buffer_mb", 128)) * MB),
            query.get("protocol", "tcp"),
            query.get("device", ""),
            parts.netloc,
        )
        if rc != 0:
            raise RuntimeError(
                f"--kv-store {url}: Mooncake Store setup failed (code {rc}); is the master running at "
                f"{parts.netloc}, the metadata server reachable, and {local!r} a non-loopback address here?"
            )

    def _exists(self, names: list[str]) -> list[bool]:
        if not names:
            return []
        codes = self._store.batch_is_exist(names)
        if any(code < 0 for code in codes):
            raise TierUnavailable(f"mooncake: batch_is_exist failed ({min(codes)})")
        return [code == 1 for code in codes]

    def _get(self, names: list[str]) -> list[bytes | None]:
        if not names:
            return []
        blobs = self._store.get_batch(names)
        return [blob if blob else None for blob in blobs]

    def _put(self, pairs: Sequence[tuple[str, bytes]]) -> None:
        if not pairs:
            return
        rc = self._store.put_batch([name for name, _ in pairs], [blob for _, blob in pairs])
        if rc != 0:
            raise TierUnavailable(f"mooncake: put_batch failed ({rc})")

    def close(self) -> None:
        self._store.close()
