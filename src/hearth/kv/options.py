"""The KV cache options (`CacheOptions`) and the tiers below device memory (`KVTierOptions`), parts of
`EngineConfig`. Torch-free: the tier package itself imports torch, so its options live here."""

from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass

from hearth.contracts.cli_common import DEFAULT_PAGE_SIZE
from hearth.contracts.options import memory_fraction, on_off, option
from hearth.kv.dtypes import KV_CACHE_DTYPE_CHOICES

KV_INTEGRITY_ACTIONS = ("recompute", "abort")


# vLLM's `fp8` is E4M3 on every GPU Hearth targets; E5M2 keeps no per-head scales and is not built.
_KV_DTYPE_ALIASES = {"fp8": "fp8_e4m3", "fp8_e4m3fn": "fp8_e4m3", "half": "float16", "float": "float32"}


def kv_cache_dtype(text: str) -> str:
    value = _KV_DTYPE_ALIASES.get(text, text)
    if value == "fp8_e5m2":
        raise argparse.ArgumentTypeError(
            "fp8_e5m2 KV caches are not supported; use --kv-cache-dtype fp8 (fp8_e4m3 with per-head scales)"
        )
    if value not in KV_CACHE_DTYPE_CHOICES:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a KV cache dtype; use one of {', '.join(KV_CACHE_DTYPE_CHOICES)} (or fp8)"
        )
    return value


_cache = functools.partial(option, group="cache")
_tiers = functools.partial(option, group="kv_tiers")


@dataclass(frozen=True)
class CacheOptions:
    """The device KV cache: its size, page size and dtype, prefix reuse, integrity checks, session retention."""

    # None: sized by `hearth.engine.kv_budget` (GPU: from free device memory and gpu_memory_utilization;
    # CPU: $VLLM_CPU_KVCACHE_SPACE GiB, else 1 GiB).
    kv_cache_memory_gib: float | None = _cache(
        None,
        flags=("--kv-cache-memory",),
        type=float,
        help="memory for the KV cache, GiB (default: GPU: what --gpu-memory-utilization leaves after the "
        "weights; CPU: $VLLM_CPU_KVCACHE_SPACE, else 1)",
    )
    page_size: int = _cache(
        DEFAULT_PAGE_SIZE, flags=("--page-size", "--block-size"), type=int, help="tokens per KV page"
    )
    enable_prefix_caching: bool = _cache(
        True,
        action=argparse.BooleanOptionalAction,
        hidden_negatives=("--no-prefix-caching",),
        help="reuse the KV of shared prompt prefixes",
    )
    kv_cache_dtype: str = _cache(
        "auto",
        type=kv_cache_dtype,
        choices=KV_CACHE_DTYPE_CHOICES,
        metavar="{" + ",".join(KV_CACHE_DTYPE_CHOICES) + ",fp8}",
        help="KV cache storage dtype (fp8 = fp8_e4m3); auto = the model's dtype; fp8_e4m3 halves the bytes per "
        "token (per-head scales from the checkpoint or a calibration pass)",
    )
    # Check every step's page tables against the pages' tags (hearth.kv.integrity).
    kv_integrity: bool = _cache(
        True,
        type=on_off,
        metavar="{on,off}",
        help="check each step's KV page tables against the pages' tags before the model reads them",
    )
    kv_integrity_action: str = _cache(
        "recompute",
        choices=KV_INTEGRITY_ACTIONS,
        help="on a page tag mismatch: recompute the request once (then fail it), or fail it at once",
    )
    # vLLM's share of device memory this server may use (weights + KV + activations).
    gpu_memory_utilization: float | None = (
        _cache(  # None: 0.9 on GPU, no cap on CPU (hearth.engine.kv_budget)
            None,
            type=memory_fraction,
            help="share of the device's memory this server may use (weights, KV cache, activations); the KV cache "
            "gets what is left of it (default 0.9). On CPU (when given): a cap on weights + KV cache as a share "
            "of the host memory available at start",
        )
    )
    # Tool-pause retention (hearth.engine.retention): seconds a session's pages stay held after its turn
    # (0: off), and the shares of the KV pages all sessions, and one tenant's sessions, may hold.
    session_retention_s: float = _cache(
        0.0,
        type=float,
        help="keep an agent session's KV pages for this long after each turn, so the next turn (after a tool "
        "call) finds them (0: off; sessions are named by the session headers or previous_response_id)",
    )
    session_retention_share: float = _cache(
        0.25, type=float, help="largest share of the KV pages that retained sessions may hold"
    )
    session_retention_tenant_share: float = _cache(
        0.1, type=float, help="largest share of the KV pages that one tenant's retained sessions may hold"
    )

    def _check_cache_options(self) -> None:
        if self.kv_cache_memory_gib is not None and self.kv_cache_memory_gib <= 0:
            raise ValueError("kv_cache_memory_gib must be > 0")
        if self.gpu_memory_utilization is not None and not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")


@dataclass(frozen=True)
class KVTierOptions:
    """Tiers below device memory (`hearth.kv.tiers`): host RAM, local disk, a cluster-shared store."""

    kv_offload_memory_gib: float = _tiers(
        0.0,
        flags=("--kv-offload-memory",),
        type=float,
        help="host RAM for KV pages evicted from the device cache, GiB (0: none)",
    )
    kv_disk_dir: str | None = _tiers(None, help="directory for a local-disk KV tier (survives restarts)")
    kv_disk_size_gib: float = _tiers(
        16.0, flags=("--kv-disk-size",), type=float, help="disk KV tier size, GiB"
    )
    kv_store: str | None = _tiers(
        None, help="cluster-shared KV store: redis://host:port[/db] or mooncake://master:port?metadata=URL"
    )

    @property
    def kv_tiers_enabled(self) -> bool:
        return bool(self.kv_offload_memory_gib > 0 or self.kv_disk_dir or self.kv_store)

    def _check_kv_tier_options(self) -> None:
        if self.kv_offload_memory_gib < 0 or self.kv_disk_size_gib <= 0:
            raise ValueError("kv_offload_memory_gib must be >= 0 and kv_disk_size_gib > 0")
