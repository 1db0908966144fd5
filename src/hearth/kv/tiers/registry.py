"""Tiers by name: `--kv-offload-memory` (host), `--kv-disk-dir` (disk) and `--kv-store URL` by its scheme.

`register_store(scheme)` adds a cluster store; store modules are imported only when a URL names them,
so redis-py or Mooncake are needed only by servers that use them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from urllib.parse import urlsplit

from hearth.kv.tiers.base import BlobStoreTier, KVTier
from hearth.kv.tiers.blob_auth import BlobMAC
from hearth.kv.tiers.disk import DiskTier
from hearth.kv.tiers.host import HostTier
from hearth.kv.tiers.page_format import PageSpec

GIB = 1 << 30
StoreFactory = Callable[[PageSpec, str], KVTier]

# scheme -> "module:class", imported on first use
_BUILTIN_STORES = {
    "redis": "hearth.kv.tiers.redis_store:RedisTier",
    "rediss": "hearth.kv.tiers.redis_store:RedisTier",
    "valkey": "hearth.kv.tiers.redis_store:RedisTier",
    "mooncake": "hearth.kv.tiers.mooncake_store:MooncakeTier",
}
_STORES: dict[str, StoreFactory] = {}


def register_store(scheme: str) -> Callable[[StoreFactory], StoreFactory]:
    def wrap(factory: StoreFactory) -> StoreFactory:
        _STORES[scheme] = factory
        return factory

    return wrap


def store_schemes() -> list[str]:
    return sorted({*_BUILTIN_STORES, *_STORES})


def open_store(spec: PageSpec, url: str, secret: bytes | None = None) -> KVTier:
    """The cluster store `url` names. Its blobs carry MACs under `secret` (the deployment's), which it
    needs: every server and client that can reach a shared store could otherwise write any page."""
    scheme = urlsplit(url).scheme
    factory = _STORES.get(scheme)
    if factory is None:
        target = _BUILTIN_STORES.get(scheme)
        if target is None:
            raise ValueError(
                f"--kv-store {url!r}: unknown scheme {scheme!r}; known: {', '.join(store_schemes())}"
            )
        module_name, class_name = target.split(":")
        factory = getattr(importlib.import_module(module_name), class_name)
    if not secret:
        raise ValueError(
            f"--kv-store {url}: a shared store needs the deployment secret to authenticate its pages: set "
            "$HEARTH_KV_TRANSFER_SECRET_FILE or $HEARTH_KV_TRANSFER_SECRET (the same on every server that "
            "shares the store)"
        )
    if scheme == "valkey":
        url = "redis" + url.removeprefix("valkey")
    tier = factory(spec, url)
    if isinstance(tier, BlobStoreTier):
        tier.mac = BlobMAC(secret)
    return tier


def build_tiers(
    spec: PageSpec,
    offload_memory_gib: float = 0.0,
    disk_dir: str | None = None,
    disk_size_gib: float = 0.0,
    store_url: str | None = None,
    secret: bytes | None = None,
) -> list[KVTier]:
    """The tiers these options ask for, fastest first: host RAM, local disk, the cluster store. `secret`
    (the deployment's) keys the MACs of stored pages; a shared store needs it."""
    tiers: list[KVTier] = []
    if offload_memory_gib > 0:
        tiers.append(HostTier(spec, int(offload_memory_gib * GIB)))
    if disk_dir:
        if disk_size_gib <= 0:
            raise ValueError("--kv-disk-dir needs --kv-disk-size GiB > 0")
        mac = BlobMAC(secret) if secret else None
        tiers.append(DiskTier(spec, disk_dir, int(disk_size_gib * GIB), mac=mac))
    if store_url:
        tiers.append(open_store(spec, store_url, secret))
    return tiers
