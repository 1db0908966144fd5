"""Paged attention: the backend interface (`backend`), a registry of implementations by name
(`registry`), and the built-in backends (`torch_ref`, `cpu`)."""

from hearth.ops.attention.backend import (
    AttentionBackend,
    AttentionContext,
    AttentionMetadata,
    AttentionStepInput,
    PagedKVCache,
    gather_pages,
    write_kv,
)
from hearth.ops.attention.registry import available_backends, get_backend, register_backend, select_backend

__all__ = [
    "AttentionBackend",
    "AttentionContext",
    "AttentionMetadata",
    "AttentionStepInput",
    "PagedKVCache",
    "available_backends",
    "gather_pages",
    "get_backend",
    "register_backend",
    "select_backend",
    "write_kv",
]
