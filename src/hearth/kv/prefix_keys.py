"""Prefix keys: the hash chain that names a full page of prompt tokens everywhere.

`key(i) = H(key(i-1), token ids of page i)`, with `key(-1)` derived from a salt covering the
model, the KV layout and the tenant. The same key names the page on the device, in host RAM, on
disk, in a shared store and in the router's prefix index, so it must be stable across processes
and machines: blake2b over little-endian token ids, never Python's `hash()`.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import MutableSequence, Sequence

KEY_BYTES = 16


def root_key(model_id: str, kv_layout: str = "", tenant: str | None = None) -> bytes:
    """key(-1): two requests share pages only if model, KV layout and tenant all match."""
    material = "\x1f".join((model_id, kv_layout, tenant or ""))
    return hashlib.blake2b(material.encode(), digest_size=KEY_BYTES, person=b"hearth-root").digest()


def page_key(parent_key: bytes, page_token_ids: Sequence[int]) -> bytes:
    data = struct.pack(f"<{len(page_token_ids)}I", *page_token_ids)
    return hashlib.blake2b(parent_key + data, digest_size=KEY_BYTES, person=b"hearth-page").digest()


def page_keys(root: bytes, token_ids: Sequence[int], page_size: int) -> list[bytes]:
    """Keys of every full page of `token_ids` (a trailing partial page has none)."""
    keys: list[bytes] = []
    extend_page_keys(keys, root, token_ids, page_size, len(token_ids) // page_size)
    return keys


def extend_page_keys(
    keys: MutableSequence[bytes], root: bytes, token_ids: Sequence[int], page_size: int, num_pages: int
) -> None:
    """Append keys to `keys` (the chain of the leading pages of `token_ids`) until it has `num_pages`.

    A sequence only grows, so the keys already computed stay valid: each page is hashed once.
    `num_pages` must not exceed the full pages of `token_ids`.
    """
    assert num_pages * page_size <= len(token_ids), "a partial page has no key"
    parent = keys[-1] if keys else root
    for index in range(len(keys), num_pages):
        start = index * page_size
        parent = page_key(parent, token_ids[start : start + page_size])
        keys.append(parent)
