"""How a KV page is written outside the process (disk files, Redis values, Mooncake objects).

A blob is a fixed header, the layout tag, then the page's raw storage bytes:

    magic "HKVP" | version u16 | tag_len u16 | key 16 B | payload_len u64 | xxh3-64 u64 | tag | payload

The reader checks everything a wrong or damaged blob could get wrong: the magic and version, that the
layout tag is this pool's (a page from another dtype, page size or model never lands), that the key is
the one asked for (a misfiled or overwritten object is not taken for another page), the payload length
(a truncated file) and the checksum (torn or flipped bytes). Any failure raises `PageFormatError`; the
caller drops the blob and recomputes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

from hearth.kv.checksum import PageChecksumError, page_checksum, verify_page_checksum
from hearth.kv.page_io import PageLayout
from hearth.kv.prefix_keys import KEY_BYTES

MAGIC = b"HKVP"
VERSION = 1
_HEADER = struct.Struct(f"<4sHH{KEY_BYTES}sQQ")


class PageFormatError(ValueError):
    """A stored page blob is not a valid page of this layout under this key."""


@dataclass(frozen=True)
class PageSpec:
    """What one page looks like in this tier stack: the rank's page layout (`hearth.kv.page_io`: the pool's
    storage dtype, page-major shape, shard) and the layout tag blobs carry (the prefix-key salt's layout
    part and this rank's place), so a page of another dtype, page size, model or rank never lands."""

    layout_tag: str
    layout: PageLayout

    @property
    def dtype(self) -> torch.dtype:
        return self.layout.storage_dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.layout.page_shape()

    @property
    def page_bytes(self) -> int:
        return self.layout.page_bytes()


def encode_page(spec: PageSpec, key: bytes, page: torch.Tensor) -> bytes:
    """A CPU page tensor (`spec.shape`, `spec.dtype`) as a self-checking blob."""
    if tuple(page.shape) != spec.shape or page.dtype != spec.dtype:
        raise ValueError(f"page {tuple(page.shape)} {page.dtype} is not {spec.shape} {spec.dtype}")
    payload = page.contiguous().view(torch.uint8).numpy().tobytes()
    tag = spec.layout_tag.encode()
    header = _HEADER.pack(MAGIC, VERSION, len(tag), key, len(payload), page_checksum(payload))
    return header + tag + payload


def decode_page(spec: PageSpec, key: bytes, blob: bytes | bytearray | memoryview) -> torch.Tensor:
    """The page tensor in a blob written by `encode_page` for `key` under `spec`; PageFormatError otherwise."""
    view = memoryview(blob)
    if len(view) < _HEADER.size:
        raise PageFormatError(f"page blob of {len(view)} bytes is shorter than its header")
    magic, version, tag_len, stored_key, payload_len, checksum = _HEADER.unpack_from(view)
    if magic != MAGIC or version != VERSION:
        raise PageFormatError(f"not a page blob (magic {magic!r}, version {version})")
    start = _HEADER.size + tag_len
    tag = bytes(view[_HEADER.size : start]).decode(errors="replace")
    if tag != spec.layout_tag:
        raise PageFormatError(f"page of layout {tag!r}, this pool is {spec.layout_tag!r}")
    if stored_key != key:
        raise PageFormatError("page blob is filed under another key")
    if payload_len != spec.page_bytes or len(view) != start + payload_len:
        raise PageFormatError(
            f"page payload is {len(view) - start} bytes (header says {payload_len}, layout {spec.page_bytes})"
        )
    payload = view[start:]
    try:
        verify_page_checksum(payload, checksum)
    except PageChecksumError as exc:
        raise PageFormatError(str(exc)) from exc
    # bytearray: a writable buffer, so the tensor owns memory torch may write (no warning, no aliasing).
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(spec.dtype).view(spec.shape)
