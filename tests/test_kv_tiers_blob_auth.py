"""Authenticated tier blobs (hearth.kv.tiers.blob_auth): a page read back from a shared store or a disk
directory is used only if a holder of the deployment secret wrote it for that key (issue 30)."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
import torch
from kv_tier_helpers import small_pool, spec_of

from hearth.kv.prefix_keys import page_keys, root_key
from hearth.kv.tiers import PageSpec, encode_page
from hearth.kv.tiers.blob_auth import KEY_FILE, OVERHEAD_BYTES, BlobAuthError, BlobMAC
from hearth.kv.tiers.disk import DiskTier
from hearth.kv.tiers.page_format import _HEADER
from hearth.kv.tiers.registry import build_tiers, open_store

SECRET = b"deployment secret"
KEYS = page_keys(root_key("m", "layout"), list(range(64)), 4)


def page(spec: PageSpec, value: float) -> torch.Tensor:
    return torch.full(spec.shape, value, dtype=spec.dtype)


def rekeyed(sealed: bytes, key: bytes) -> bytes:
    """Another key's blob with the key bytes in its header rewritten (the MAC prefix kept as it was)."""
    inner = bytearray(sealed[OVERHEAD_BYTES:])
    start = _HEADER.size - len(key) - 16  # the key sits before payload_len u64 and xxh3 u64
    inner[start : start + len(key)] = key
    return sealed[:OVERHEAD_BYTES] + bytes(inner)


def test_a_seal_opens_only_under_its_key_and_secret() -> None:
    spec = spec_of(small_pool())
    blob = encode_page(spec, KEYS[0], page(spec, 1.0))
    sealed = BlobMAC(SECRET).seal(KEYS[0], blob)
    assert bytes(BlobMAC(SECRET).open(KEYS[0], sealed)) == blob
    with pytest.raises(BlobAuthError, match="mismatch"):
        BlobMAC(SECRET).open(KEYS[1], sealed)
    with pytest.raises(BlobAuthError, match="mismatch"):
        BlobMAC(b"another deployment").open(KEYS[0], sealed)
    with pytest.raises(BlobAuthError, match="no MAC"):
        BlobMAC(SECRET).open(KEYS[0], blob)  # an unsealed, well-formed page
    flipped = bytearray(sealed)
    flipped[-1] ^= 1
    with pytest.raises(BlobAuthError):
        BlobMAC(SECRET).open(KEYS[0], bytes(flipped))


def test_a_forged_redis_blob_is_refused_counted_and_never_served(redis_server) -> None:
    """Issue 30: any Redis client copied another key's blob under a key, with the key bytes in its header
    rewritten; the tier served it. Now it fails its MAC: counted invalid, not loaded (recomputed)."""
    spec = spec_of(small_pool())
    writer, reader = open_store(spec, redis_server.url, SECRET), open_store(spec, redis_server.url, SECRET)
    writer.store([(KEYS[0], page(spec, 1.0)), (KEYS[1], page(spec, 2.0))])
    client = redis.Redis.from_url(redis_server.url)
    stolen = client.get(writer.object_name(KEYS[0]))
    client.set(writer.object_name(KEYS[1]), rekeyed(stolen, KEYS[1]))
    client.set(writer.object_name(KEYS[2]), encode_page(spec, KEYS[2], page(spec, 3.0)))  # no MAC at all
    loaded = reader.load(KEYS[:1])
    assert len(loaded) == 1 and float(loaded[0].flatten()[0]) == 1.0
    assert reader.load(KEYS[1:2]) == [] and reader.load(KEYS[2:3]) == []
    assert reader.snapshot().invalid_pages == 2
    other = open_store(spec, redis_server.url, b"other deployment")  # same store, another secret
    assert other.load(KEYS[:1]) == []
    client.close()


def test_a_shared_store_without_a_secret_is_refused_at_start() -> None:
    spec = spec_of(small_pool())
    with pytest.raises(ValueError, match="deployment secret"):
        build_tiers(spec, store_url="redis://127.0.0.1:1")


def test_disk_pages_are_maced_with_the_directory_key_across_restarts(tmp_path: Path) -> None:
    spec = spec_of(small_pool())
    disk = DiskTier(spec, tmp_path, 1 << 20)
    disk.store([(KEYS[0], page(spec, 1.0)), (KEYS[1], page(spec, 2.0))])
    assert (tmp_path / KEY_FILE).stat().st_mode & 0o077 == 0  # owner-only
    forged = rekeyed(disk.path(KEYS[0]).read_bytes(), KEYS[1])
    disk.path(KEYS[1]).write_bytes(forged)
    again = DiskTier(spec, tmp_path, 1 << 20)  # a restart: the same key, read back from the directory
    assert float(again.load(KEYS[:1])[0].flatten()[0]) == 1.0
    assert again.load(KEYS[1:2]) == [] and again.snapshot().invalid_pages == 1
    assert not again.path(KEYS[1]).exists()  # dropped
    with_secret = DiskTier(spec, tmp_path, 1 << 20, mac=BlobMAC(SECRET))  # another key: nothing verifies
    assert with_secret.load(KEYS[:1]) == []


def test_a_ranks_shard_is_sealed_under_its_own_shard_key(redis_server) -> None:
    """Under tensor parallelism each rank files its shard of a page under its shard key and seals it with
    that key: rank 1's blob copied under rank 0's name (header key rewritten too) fails rank 0's MAC."""
    from kv_tier_helpers import LAYOUT

    from hearth.kv.page_io import PageLayout

    shards = [PageLayout.of(LAYOUT, first_kv_head=rank, total_kv_heads=2) for rank in range(2)]
    specs = [PageSpec("same-tag", layout) for layout in shards]  # only the key tells the ranks apart
    ranks = [open_store(spec, redis_server.url, SECRET) for spec in specs]
    keys = [layout.shard_key(KEYS[5]) for layout in shards]
    assert keys[0] != keys[1]
    ranks[1].store([(keys[1], page(specs[1], 9.0))])
    client = redis.Redis.from_url(redis_server.url)
    client.set(ranks[0].object_name(keys[0]), rekeyed(client.get(ranks[1].object_name(keys[1])), keys[0]))
    assert ranks[0].load([keys[0]]) == [] and ranks[0].snapshot().invalid_pages == 1
    assert float(ranks[1].load([keys[1]])[0].flatten()[0]) == 9.0
    client.close()
