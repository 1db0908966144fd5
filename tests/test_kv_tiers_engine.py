"""KV tiers under a real engine: a prefix evicted from a small device pool comes back from host RAM, the
disk tier outlives the engine, two engines share pages through Redis (never across cache salts), and a
Redis that dies mid-run costs recomputation, not errors. Greedy outputs are compared with the same
engine's answer before any tier was involved."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from hearth.engine.llm import LLM
from hearth.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0)
PAGE = 16


@pytest.fixture(autouse=True)
def _torch_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    # The compiled CPU kernels load in the background and may take over mid-test; the torch paths
    # keep every answer of a test on one code path (tiers move bytes, not arithmetic).
    monkeypatch.setenv("HEARTH_CPU_KERNELS", "0")


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 250) for _ in range(length)]


def engine(model: Path, num_pages: int, **tier_options) -> LLM:
    llm = LLM(str(model), device="cpu", num_threads=1, page_size=PAGE, dtype="float32", **tier_options)
    # Size the device pool in pages: small enough that one long prompt pushes another out.
    layout_bytes = llm.engine.worker.kv_pool.layout.bytes_per_page
    llm.engine.close()
    llm = LLM(
        str(model),
        device="cpu",
        num_threads=1,
        page_size=PAGE,
        dtype="float32",
        kv_cache_memory_gib=num_pages * layout_bytes / (1 << 30),
        **tier_options,
    )
    # Decode attention on main lets NaN in never-written slots (torch.empty reuses freed memory)
    # through its masked positions; zeroed pools keep the greedy comparison about the tiers.
    llm.engine.worker.kv_pool.storage.zero_()
    return llm


def tier_stats(llm: LLM) -> dict:
    return {s.name: s for s in llm.engine.worker.kv_worker.tiers.stats()}


def flush(llm: LLM) -> None:
    assert llm.engine.worker.kv_worker.tiers.flush()


def test_prefix_evicted_from_a_small_device_pool_is_served_from_host(tiny_llama: Path):
    llm = engine(tiny_llama, num_pages=12, kv_offload_memory_gib=0.01)
    try:
        assert llm.engine.kv.num_pages == 12
        first = prompt(1, 100)  # 6 full pages
        before = llm.generate([first], GREEDY)[0]
        assert before.cached_tokens == 0
        llm.generate([prompt(2, 180)], GREEDY)  # needs all 12 pages: the first prompt's are evicted
        assert llm.engine.kv.prefix_cache.num_parked_pages == 11  # only the second prompt's pages
        again = llm.generate([first], GREEDY)[0]
        assert again.cached_tokens == 96  # every full page, from host RAM
        assert again.token_ids == before.token_ids
        host = tier_stats(llm)["host"]
        assert host.hit_pages == 6 and host.hit_bytes == 6 * llm.engine.worker.kv_pool.layout.bytes_per_page
        assert llm.engine.stats().kv_tiers[0].name == "host"
    finally:
        llm.engine.close()


def test_disk_tier_survives_a_restart(tiny_llama: Path, tmp_path: Path):
    options = {"kv_disk_dir": str(tmp_path / "kv"), "kv_disk_size_gib": 0.01}
    tokens = prompt(3, 90)
    first = engine(tiny_llama, num_pages=16, **options)
    try:
        before = first.generate([tokens], GREEDY)[0]
        flush(first)
        assert tier_stats(first)["disk"].written_pages == 5
    finally:
        first.engine.close()
    second = engine(tiny_llama, num_pages=16, **options)  # a new engine: empty device cache
    try:
        after = second.generate([tokens], GREEDY)[0]
        assert after.cached_tokens == 80 and after.token_ids == before.token_ids
        assert tier_stats(second)["disk"].hit_pages == 5
    finally:
        second.engine.close()


def test_damaged_disk_pages_are_recomputed_not_loaded(tiny_llama: Path, tmp_path: Path):
    options = {"kv_disk_dir": str(tmp_path / "kv"), "kv_disk_size_gib": 0.01}
    tokens = prompt(4, 90)
    first = engine(tiny_llama, num_pages=16, **options)
    try:
        before = first.generate([tokens], GREEDY)[0]
        flush(first)
    finally:
        first.engine.close()
    files = sorted((tmp_path / "kv").glob("*/*.kvpage"), key=lambda p: p.stat().st_mtime_ns)
    assert len(files) == 5
    third_page = files[2]  # written in page order
    third_page.write_bytes(third_page.read_bytes()[:100])  # torn
    second = engine(tiny_llama, num_pages=16, **options)
    try:
        after = second.generate([tokens], GREEDY)[0]
        assert after.cached_tokens == 32  # pages 0 and 1; the torn page 2 and everything after recomputed
        assert after.token_ids == before.token_ids
        assert tier_stats(second)["disk"].invalid_pages == 1
        flush(second)  # the recomputed pages are written back: the torn file is whole again
        assert third_page.stat().st_size == files[0].stat().st_size
    finally:
        second.engine.close()


def test_two_engines_share_pages_through_redis_and_salts_keep_tenants_apart(
    tiny_llama: Path, redis_server, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("HEARTH_KV_TRANSFER_SECRET", "tier-secret")  # a shared store's blobs are MAC'd
    a = engine(tiny_llama, num_pages=32, kv_store=redis_server.url)
    b = engine(tiny_llama, num_pages=32, kv_store=redis_server.url)
    try:
        tokens = prompt(5, 200)
        on_a = a.generate([tokens], GREEDY)[0]
        flush(a)
        on_b = b.generate([tokens], GREEDY)[0]
        assert on_b.cached_tokens >= 0.9 * len(tokens) and on_b.cached_tokens == 192
        assert on_b.token_ids == on_a.token_ids
        assert tier_stats(b)["redis"].hit_pages == 12
        other_tenant = b.generate([tokens], GREEDY, cache_salt="tenant-2")[0]
        assert other_tenant.cached_tokens == 0
        assert other_tenant.token_ids == on_a.token_ids
    finally:
        a.engine.close()
        b.engine.close()


def test_redis_dying_mid_run_means_recompute_and_writes_resume_when_it_is_back(
    tiny_llama: Path, redis_server, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("HEARTH_KV_TRANSFER_SECRET", "tier-secret")
    llm = engine(tiny_llama, num_pages=32, kv_store=redis_server.url)
    stack = llm.engine.worker.kv_worker.tiers
    stack.retry_after_s = 0.2
    try:
        llm.generate([prompt(6, 70)], GREEDY)
        flush(llm)
        written = tier_stats(llm)["redis"].written_pages
        assert written == 4
        redis_server.stop()
        results = llm.generate([prompt(7 + i, 70) for i in range(3)], GREEDY)
        assert all(r.finish_reason == "length" and len(r.token_ids) == 6 for r in results)
        flush(llm)
        stats = tier_stats(llm)["redis"]
        assert stats.failed_writes + stats.dropped_writes >= 4 and stats.written_pages == written
        redis_server.start()  # back, empty
        import time

        time.sleep(0.25)
        llm.generate([prompt(20, 70)], GREEDY)
        flush(llm)
        assert tier_stats(llm)["redis"].written_pages == written + 4
    finally:
        llm.engine.close()
