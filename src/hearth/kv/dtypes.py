"""`--kv-cache-dtype` names, checked without importing torch (the CLI validates options before it loads anything)."""

from __future__ import annotations

KV_CACHE_DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32", "fp8_e4m3")


class KVCacheDtypeError(ValueError):
    pass


def check_kv_cache_dtype(name: str) -> None:
    """Raises KVCacheDtypeError unless `name` is a KV dtype this build can store."""
    if name not in KV_CACHE_DTYPE_CHOICES:
        raise KVCacheDtypeError(
            f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPE_CHOICES)}, got {name!r}"
        )
