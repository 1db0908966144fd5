"""The KV cache's size when `--kv-cache-memory` is not given: vLLM's GPU rule and Hearth's CPU rule."""

from __future__ import annotations

from pathlib import Path

import pytest

from hearth.engine import kv_budget
from hearth.engine.config import EngineConfig

GIB = 1 << 30


def test_gpu_share_is_what_the_utilization_leaves_after_others_weights_and_reserve() -> None:
    # 100 GiB device, 10 GiB held elsewhere, 0.9 allowed: 90 - 10 - 16 (weights) - 2 (reserve) = 62 GiB.
    assert kv_budget.gpu_kv_bytes(0.9, 90 * GIB, 100 * GIB, 16 * GIB, 2 * GIB) == 62 * GIB


def test_cpu_default_is_1_gib_or_vllm_cpu_kvcache_space(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    assert kv_budget.cpu_kv_bytes(None, 100 * GIB, GIB) == GIB
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    assert kv_budget.cpu_kv_bytes(None, 100 * GIB, GIB) == 3 * GIB


def test_cpu_utilization_caps_weights_plus_kv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    # 0.5 of 2 GiB available, 0.75 GiB of weights: 0.25 GiB left for the KV cache.
    assert kv_budget.cpu_kv_bytes(0.5, 2 * GIB, 3 * GIB // 4) == GIB // 4


def test_explicit_kv_memory_wins_and_a_cpu_cap_with_no_room_names_the_options(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1024)
    config = EngineConfig(model=str(tmp_path), kv_cache_memory_gib=0.5, gpu_memory_utilization=0.1)
    assert kv_budget.resolve_kv_cache_bytes(config, "cpu") == GIB // 2
    assert kv_budget.checkpoint_bytes(str(tmp_path)) == 1024
    tiny_share = EngineConfig(model=str(tmp_path), gpu_memory_utilization=1e-12)
    with pytest.raises(ValueError, match="--kv-cache-memory"):
        kv_budget.resolve_kv_cache_bytes(tiny_share, "cpu")
