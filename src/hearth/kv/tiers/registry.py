"""Tiers by name: `--kv-offload-memory` (host), `--kv-disk-dir` (disk) and `--kv-store URL` by its scheme.

`KV_STORES` names each cluster store's factory by URL scheme, as lazy `"module:Class"` entries: a store's
module is imported only when a URL names it, so redis-py or Mooncake are needed only by servers that use
them. `register_store(scheme)` adds one from outside.
"""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import urlsplit

from hearth.contracts.registry import Registry
from hearth.kv.tiers.base import BlobStoreTier, KVTier
from hearth.kv.tiers.blob_auth import BlobMAC
from hearth.kv.tiers.disk import DiskTier
from hearth.kv.tiers.host import HostTier
from hearth.kv.tiers.page_format import PageSpec

GIB = 1 << 30
StoreFactory = Callable[[PageSpec, str], KVTier]

KV_STORES: Registry[StoreFactory] = Registry("KV store scheme")
# Each scheme is its own name (not an alias): the URL keeps the scheme it was given.
for _scheme in ("redis", "rediss", "valkey"):
    KV_STORES.add(_scheme, "hearth.kv.tiers.redis_store:RedisTier")
KV_STORES.add("mooncake", "hearth.kv.tiers.mooncake_store:MooncakeTier")


def register_store(scheme: str) -> Callable[[StoreFactory], StoreFactory]:
    """Decorator: `--kv-store SCHEME://...` opens its store with this factory."""
    return KV_STORES.register(scheme)


def store_schemes() -> list[str]:
    return list(KV_STORES.names())


def open_store(spec: PageSpec, url: str, secret: bytes | None = None) -> KVTier:
    """The cluster store `url` names. Its blobs carry MACs under `secret` (the deployment's), which it
    needs: every server and client that can reach a shared store could otherwise write any page."""
    scheme = urlsplit(url).scheme
    factory = KV_STORES.get(scheme)
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
