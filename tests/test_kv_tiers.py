"""KV tiers without an engine: the page blob format, host RAM, local disk, Redis, and the tier stack's
threads (prefetch into the pool, bounded write-back, a store that fails or stalls)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from kv_tier_helpers import fill_page, small_pool, spec_of

from hearth.kv.prefix_keys import page_keys, root_key
from hearth.kv.tiers import PageFormatError, PageSpec, TierStack, TierUnavailable, decode_page, encode_page
from hearth.kv.tiers.base import KVTier
from hearth.kv.tiers.blob_auth import OVERHEAD_BYTES
from hearth.kv.tiers.disk import DiskTier
from hearth.kv.tiers.host import HostTier
from hearth.kv.tiers.registry import build_tiers, open_store

SECRET = b"deployment secret"
KEYS = page_keys(root_key("m", "layout"), list(range(64)), 4)  # 16 chained keys


def page(spec: PageSpec, value: float) -> torch.Tensor:
    return torch.full(spec.shape, value, dtype=spec.dtype)


# ---- the blob format ----------------------------------------------------------------------------


def test_blob_round_trips_and_rejects_wrong_layout_key_truncation_and_flipped_bytes():
    spec = spec_of(small_pool())
    data = torch.randn(spec.shape)
    blob = encode_page(spec, KEYS[0], data)
    assert torch.equal(decode_page(spec, KEYS[0], blob), data)
    other_layout = PageSpec(spec.layout_tag + "x", spec.layout)
    with pytest.raises(PageFormatError, match="layout"):
        decode_page(other_layout, KEYS[0], blob)
    with pytest.raises(PageFormatError, match="another key"):
        decode_page(spec, KEYS[1], blob)
    with pytest.raises(PageFormatError, match="payload"):
        decode_page(spec, KEYS[0], blob[:-5])
    with pytest.raises(PageFormatError, match="header"):
        decode_page(spec, KEYS[0], blob[:10])
    flipped = bytearray(blob)
    flipped[-3] ^= 0x40
    with pytest.raises(PageFormatError, match="checksum"):
        decode_page(spec, KEYS[0], bytes(flipped))


# ---- host RAM -------------------------------------------------------------------------------------


def test_host_tier_is_lru_bounded_and_hands_back_what_it_pushes_out():
    spec = spec_of(small_pool())
    host = HostTier(spec, capacity_bytes=3 * spec.page_bytes)
    assert host.put([(KEYS[i], page(spec, i)) for i in range(3)]) == []
    assert host.load([KEYS[0]])[0][0, 0, 0, 0, 0] == 0  # touches key 0: key 1 is now the oldest
    spilled = host.put([(KEYS[3], page(spec, 3))])
    assert [key for key, _ in spilled] == [KEYS[1]]
    assert host.lookup(KEYS[:4]) == 1 and host.lookup([KEYS[2], KEYS[3]]) == 2
    assert host.usage() == (3, 3 * spec.page_bytes)


# ---- local disk -----------------------------------------------------------------------------------


def test_disk_tier_survives_a_restart_and_drops_torn_temp_files(tmp_path: Path):
    spec = spec_of(small_pool())
    disk = DiskTier(spec, tmp_path, capacity_bytes=1 << 20)
    disk.store([(KEYS[i], page(spec, i)) for i in range(4)])
    torn = disk.path(KEYS[5]).with_name("x.kvpage.1.2.tmp")
    torn.parent.mkdir(exist_ok=True)
    torn.write_bytes(b"half a page")
    again = DiskTier(spec, tmp_path, capacity_bytes=1 << 20)  # a new process
    assert not torn.exists()
    assert again.lookup(KEYS) == 4
    loaded = again.load(KEYS[:4])
    assert [float(p.flatten()[0]) for p in loaded] == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("damage", ["truncate", "flip", "other_key"])
def test_disk_tier_never_loads_a_damaged_page_file(tmp_path: Path, damage: str):
    spec = spec_of(small_pool())
    disk = DiskTier(spec, tmp_path, capacity_bytes=1 << 20)
    disk.store([(KEYS[i], page(spec, i)) for i in range(3)])
    path = disk.path(KEYS[1])
    blob = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(blob[: len(blob) // 2])
    elif damage == "flip":
        path.write_bytes(blob[:-1] + bytes([blob[-1] ^ 1]))
    else:  # a file renamed onto another page's name
        path.write_bytes(disk.path(KEYS[2]).read_bytes())
    restarted = DiskTier(spec, tmp_path, capacity_bytes=1 << 20)
    assert restarted.lookup(KEYS[:3]) == 3  # the index cannot know: the read checks
    loaded = restarted.load(KEYS[:3])
    assert len(loaded) == 1 and float(loaded[0].flatten()[0]) == 0.0  # stops before the bad page
    assert not path.exists() and restarted.lookup(KEYS[:3]) == 1  # deleted, forgotten
    assert restarted.snapshot().invalid_pages == 1


def test_disk_tier_stays_within_its_size_evicting_least_recent(tmp_path: Path):
    spec = spec_of(small_pool())
    blob_bytes = len(encode_page(spec, KEYS[0], page(spec, 0))) + OVERHEAD_BYTES  # the page and its MAC
    disk = DiskTier(spec, tmp_path / "b", capacity_bytes=3 * blob_bytes)
    disk.store([(KEYS[i], page(spec, i)) for i in range(3)])
    disk.load([KEYS[0]])
    disk.store([(KEYS[3], page(spec, 3))])
    assert [disk.knows(k) for k in KEYS[:4]] == [True, False, True, True]
    assert disk.usage() == (3, 3 * blob_bytes)
    assert len(list(tmp_path.glob("b/*/*.kvpage"))) == 3


# ---- Redis ----------------------------------------------------------------------------------------


def test_redis_tier_shares_pages_between_clients_and_fails_as_unavailable(redis_server):
    spec = spec_of(small_pool())
    writer, reader = open_store(spec, redis_server.url, SECRET), open_store(spec, redis_server.url, SECRET)
    writer.store([(KEYS[i], page(spec, i)) for i in range(3)])
    assert reader.lookup(KEYS) == 3 and reader.knows(KEYS[0])
    assert [float(p.flatten()[0]) for p in reader.load(KEYS)] == [0.0, 1.0, 2.0]
    other_layout = open_store(PageSpec("other", spec.layout), redis_server.url, SECRET)
    assert other_layout.load(KEYS[:1]) == []  # same key, other layout: rejected by the header
    redis_server.stop()
    with pytest.raises(TierUnavailable):
        reader.lookup(KEYS)
    with pytest.raises(TierUnavailable):
        writer.store([(KEYS[5], page(spec, 5))])


def test_unknown_store_scheme_is_a_clear_error():
    spec = spec_of(small_pool())
    with pytest.raises(
        ValueError, match="unknown KV store scheme 'memcached'; choose one of mooncake, redis"
    ):
        build_tiers(spec, store_url="memcached://x:1", secret=SECRET)


# ---- the stack ------------------------------------------------------------------------------------


class SlowTier(KVTier):
    """A store that takes `delay_s` per write and can be told to fail."""

    name = "slow"
    local = False

    def __init__(self, spec: PageSpec, delay_s: float = 0.0) -> None:
        super().__init__(spec)
        self.delay_s = delay_s
        self.fail = False
        self.pages: dict[bytes, torch.Tensor] = {}
        self.release = threading.Event()
        self.release.set()

    def _check(self) -> None:
        if self.fail:
            raise TierUnavailable("down")

    def lookup(self, keys):
        self._check()
        return next((i for i, k in enumerate(keys) if k not in self.pages), len(keys))

    def load(self, keys):
        self._check()
        self.release.wait()
        return [self.pages[k] for k in keys[: self.lookup(keys)]]

    def store(self, items):
        self._check()
        time.sleep(self.delay_s)
        self.pages.update(items)

    def knows(self, key):
        return key in self.pages


def wait_for(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_eviction_spills_to_host_then_disk_and_a_load_fills_the_pool(tmp_path: Path):
    pool = small_pool()
    spec = spec_of(pool)
    host = HostTier(spec, 2 * spec.page_bytes)
    disk = DiskTier(spec, tmp_path, 1 << 20)
    stack = TierStack([host, disk], pool.io)
    try:
        originals = [fill_page(pool, i, 10 + i) for i in range(3)]
        for i in range(3):
            stack.on_evict(KEYS[i], i)  # page 0 is pushed from host to disk by page 2
        assert stack.flush()
        assert [host.knows(k) for k in KEYS[:3]] == [False, True, True] and disk.knows(KEYS[0])
        assert stack.lookup(KEYS[:5]) == 3  # leading run across tiers: disk, host, host
        stack.start_load("r", KEYS[:3], [5, 6, 7])
        wait_for(lambda: stack._done)
        assert stack.poll() == [("r", 3)]
        for i, page_id in enumerate([5, 6, 7]):
            assert torch.equal(pool.read_pages([page_id]), originals[i])
        stats = {s.name: s for s in stack.stats()}
        assert (stats["disk"].hit_pages, stats["host"].hit_pages) == (1, 2)
    finally:
        stack.close()


def test_a_load_says_how_many_of_its_pages_a_shared_store_served():
    pool = small_pool()
    spec = spec_of(pool)
    host = HostTier(spec, 4 * spec.page_bytes)
    store = SlowTier(spec)  # not local: a shared store
    host.store([(KEYS[0], page(spec, 1.0))])
    store.pages[KEYS[1]] = page(spec, 2.0)
    store.pages[KEYS[2]] = page(spec, 3.0)
    stack = TierStack([host, store], pool.io)
    try:
        stack.start_load("r", KEYS[:3], [4, 5, 6])
        wait_for(lambda: stack._done)
        assert stack.poll_by_source() == [("r", 3, 2)]
    finally:
        stack.close()


def test_a_cancelled_load_never_writes_the_pool():
    pool = small_pool()
    spec = spec_of(pool)
    store = SlowTier(spec)
    store.pages[KEYS[0]] = page(spec, 7.0)
    store.release.clear()  # the load is in flight until released
    stack = TierStack([store], pool.io)
    try:
        stack.start_load("r", KEYS[:1], [3])
        stack.cancel("r")
        store.release.set()
        stack.flush()
        time.sleep(0.05)
        assert stack.poll() == [] and float(pool.read_pages([3]).abs().sum()) == 0.0
    finally:
        stack.close()


def test_a_load_that_times_out_is_answered_with_nothing():
    pool = small_pool()
    spec = spec_of(pool)
    store = SlowTier(spec)
    store.pages[KEYS[0]] = page(spec, 7.0)
    store.release.clear()
    stack = TierStack([store], pool.io, load_timeout_s=0.05)
    try:
        stack.start_load("r", KEYS[:1], [3])
        time.sleep(0.1)
        assert stack.poll() == [("r", 0)]
        store.release.set()
        time.sleep(0.05)
        assert stack.poll() == [] and float(pool.read_pages([3]).abs().sum()) == 0.0
    finally:
        stack.close()


def test_a_slow_store_drops_writes_instead_of_blocking_the_engine():
    pool = small_pool()
    spec = spec_of(pool)
    store = SlowTier(spec, delay_s=0.2)
    stack = TierStack([store], pool.io, write_queue_bytes=16 * spec.page_bytes)  # a 16-page queue
    try:
        keys = page_keys(root_key("m", "slow"), list(range(4 * 100)), 4)
        started = time.perf_counter()
        for start in range(0, 100, 4):
            stack.write_back(keys[start : start + 4], [0, 1, 2, 3])
        assert time.perf_counter() - started < 0.15  # never waited for the 0.2 s store
        (stats,) = stack.stats()
        assert stats.dropped_writes >= 100 - 16 - 64  # the queue, and one batch in the writer, at most
    finally:
        stack.close()


def test_a_store_that_goes_down_is_skipped_then_tried_again():
    pool = small_pool()
    spec = spec_of(pool)
    store = SlowTier(spec)
    stack = TierStack([store], pool.io, retry_after_s=0.1)
    try:
        store.fail = True
        assert stack.lookup(KEYS[:2]) == 0  # down: no error, nothing held
        stack.write_back(KEYS[:2], [0, 1])
        assert store.pages == {} and stack.stats()[0].dropped_writes == 2
        store.fail = False
        stack.write_back(KEYS[:2], [0, 1])  # still inside retry_after_s: dropped
        assert stack.flush() and store.pages == {}
        time.sleep(0.12)
        stack.write_back(KEYS[:2], [0, 1])
        assert stack.flush() and set(store.pages) == set(KEYS[:2])
        assert stack.lookup(KEYS[:3]) == 2
    finally:
        stack.close()


class TinyFilesystem:
    """A filesystem of `limit_bytes` (smaller than the tier's capacity): a write past it leaves a partial
    temp file and fails with ENOSPC, as a real full disk does."""

    def __init__(self, directory: Path, limit_bytes: int) -> None:
        self.directory, self.limit_bytes = directory, limit_bytes

    def __call__(self, tmp: Path, blob: bytes) -> None:
        import errno
        import os

        used = sum(p.stat().st_size for p in self.directory.rglob("*") if p.is_file())
        with open(tmp, "wb") as file:
            file.write(blob[: max(0, min(len(blob), self.limit_bytes - used))])
        if used + len(blob) > self.limit_bytes:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_filesystem_leaves_no_temp_files_evicts_and_keeps_writing(tmp_path: Path, caplog):
    spec = spec_of(small_pool())
    disk = DiskTier(spec, tmp_path, capacity_bytes=1 << 30)  # far more than the filesystem holds
    blob_bytes = len(encode_page(spec, KEYS[0], page(spec, 0))) + OVERHEAD_BYTES
    disk._write_file = TinyFilesystem(tmp_path, 6 * blob_bytes + 100)  # type: ignore[method-assign]
    caplog.set_level("WARNING", logger="hearth.kv.tiers")
    for i in range(16):
        disk.store([(KEYS[i], page(spec, i))])
    assert not list(tmp_path.rglob("*.tmp"))
    assert disk.capacity_bytes < 6 * blob_bytes  # lowered to what the filesystem holds
    assert disk.knows(KEYS[15]) and not disk.knows(KEYS[0])  # the newest kept, the oldest evicted
    assert float(disk.load([KEYS[15]])[0].flatten()[0]) == 15.0
    assert len(caplog.records) <= 3 and not any(r.exc_info for r in caplog.records)


def test_write_failures_are_counted_and_logged_once_per_cause_as_the_count_doubles(tmp_path: Path, caplog):
    import errno

    spec = spec_of(small_pool())
    disk = DiskTier(spec, tmp_path, capacity_bytes=1 << 20)

    def broken(tmp: Path, blob: bytes) -> None:
        tmp.write_bytes(blob[:10])
        raise OSError(errno.EIO, "Input/output error")

    disk._write_file = broken  # type: ignore[method-assign]
    caplog.set_level("WARNING", logger="hearth.kv.tiers")
    disk.store([(KEYS[i % 16], page(spec, i)) for i in range(16)])
    assert disk.snapshot().failed_writes == 16 and disk.usage() == (0, 0)
    assert not list(tmp_path.rglob("*.tmp"))
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 5 and all("EIO" in m for m in messages)  # counts 1, 2, 4, 8, 16
    assert "16 page write(s) failed" in messages[-1] and not any(r.exc_info for r in caplog.records)
