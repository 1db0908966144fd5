"""Server roles: the peer connector a prefill or decode server's engine gets, and the deployment secret."""

from __future__ import annotations

from hearth.engine.config import EngineConfig
from hearth.kv.manager import KVCacheManager
from hearth.kv.pool import KVPool
from hearth.kv_transfer import make_transport
from hearth.kv_transfer.auth import deployment_secret
from hearth.kv_transfer.connector import PeerKVConnector, pool_sink, wire_layout


def peer_connector(config: EngineConfig, kv: KVCacheManager, pool: KVPool) -> PeerKVConnector:
    transport = make_transport(
        config.kv_transfer,
        wire_layout(pool.layout),
        deployment_secret(),
        config.kv_transfer_timeout_s,
        pool_sink(pool),
    )
    return PeerKVConnector(transport, kv, pool, config.kv_transfer_timeout_s)
