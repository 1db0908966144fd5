"""Server roles: the peer connector a prefill or decode server's engine gets, and the deployment secret."""

from __future__ import annotations

import os

from hearth.engine.config import EngineConfig
from hearth.kv.manager import KVCacheManager
from hearth.kv.pool import KVPool
from hearth.kv_transfer import make_transport
from hearth.kv_transfer.connector import PeerKVConnector, pool_sink, wire_layout

SECRET_ENV = "HEARTH_KV_TRANSFER_SECRET"


class MissingSecretError(ValueError):
    pass


def deployment_secret() -> bytes:
    """The shared secret both ends of a transfer must prove they hold (from the environment, so it
    never shows in a process list)."""
    secret = os.environ.get(SECRET_ENV, "")
    if not secret:
        raise MissingSecretError(
            "prefill and decode servers need the deployment's KV transfer secret: pass "
            f"--kv-transfer-secret or set ${SECRET_ENV} (the same value on every server; "
            "`hearth launch` makes one)"
        )
    return secret.encode()


def peer_connector(config: EngineConfig, kv: KVCacheManager, pool: KVPool) -> PeerKVConnector:
    transport = make_transport(
        config.kv_transfer,
        wire_layout(pool.layout),
        deployment_secret(),
        config.kv_transfer_timeout_s,
        pool_sink(pool),
    )
    return PeerKVConnector(transport, kv, pool, config.kv_transfer_timeout_s)
