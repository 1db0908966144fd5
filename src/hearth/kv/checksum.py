"""Checksums of KV page bytes where pages cross a boundary (PD transfer, host/disk/cluster tiers).

The writer computes `page_checksum` over a page's bytes; the reader recomputes it and drops the page
on a mismatch (`PageChecksumError`). xxh3-64: several GB/s per core, so it never bounds a transfer.
"""

from __future__ import annotations

import torch
import xxhash


class PageChecksumError(ValueError):
    """A page's bytes do not match the checksum its writer recorded."""


def page_checksum(data: bytes | bytearray | memoryview | torch.Tensor) -> int:
    """xxh3-64 of the bytes; a tensor is hashed as its contiguous CPU bytes."""
    if isinstance(data, torch.Tensor):
        data = data.detach().contiguous().cpu().view(torch.uint8).numpy().data
    return xxhash.xxh3_64_intdigest(data)


def verify_page_checksum(data: bytes | bytearray | memoryview | torch.Tensor, expected: int) -> None:
    found = page_checksum(data)
    if found != expected:
        raise PageChecksumError(f"page checksum mismatch: expected {expected:#018x}, found {found:#018x}")
