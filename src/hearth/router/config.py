"""The router's settings, one frozen dataclass filled from the command line."""

from __future__ import annotations

from dataclasses import dataclass, field

from hearth.router.policies import BalanceConfig


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    policy: str = "default"
    pd_protocol: str = "hearth"
    balance: BalanceConfig = field(default_factory=BalanceConfig)
    # Health: a dead worker is out within interval + timeout (1.5 s with the defaults).
    health_interval_s: float = 0.5
    health_timeout_s: float = 1.0
    connect_timeout_s: float = 2.0
    # Longest silence allowed from a worker while its response is in progress.
    read_timeout_s: float = 600.0
    admin_key: str | None = None
    tokenizer_dir: str | None = None
    model_id: str = "hearth"
    page_size: int = 16
    prefix_index_blocks: int = 65536
    # Longest time a finished answer waits for the prefill side's usage before the decode side's goes out
    # as is. The prefill answer normally comes before the decode's (the KV moved first); a stopped or
    # overloaded prefill server must not hold finished answers (and their connections) for long.
    prefill_usage_wait_s: float = 2.0
    # The deployment's KV transfer secret: the router signs Hearth PD instructions with it.
    kv_transfer_secret: bytes | None = field(default=None, repr=False)
