"""KV-cache integrity: before a step reads or writes the cache, every page table entry is checked against
the tag the pool holds for that page, in one batched comparison shared by all layers.

The engine records, for every page a request holds, the tag the allocator gave that page when the request
got it (`request.page_generations`, beside `page_ids`). The worker's pool holds each page's current tag
(`KVPool.page_tags`, written as pages are handed out). A page reused by another request has a new tag; an
entry pointing at the wrong page (a swapped or stale id) finds another page's tag, since tags are unique
across the pool (`PageAllocator`). Either way the row is reported and the engine stops it before any of
its tokens are returned.

`BatchedPageTagCheck` is one gather and one compare over the step's `[num_rows, width]` page table;
`NoPageTagCheck` is the tracker when checking is off: it does nothing, and the step input carries no
expected tags.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from hearth.contracts.step import PageTagMismatch
from hearth.ops import cpu_kernels

# Expected tag of a page table's padding entries (the allocator's tags start at 1): never compared.
PADDING_TAG = -1


class PageTagCheck(Protocol):
    """The integrity tracker on the worker side.

    Contract: `check(pool_tags, page_table, width, expected_tags)` compares a step's row-major
    `[num_rows, width]` page table (a flat list) with the expected tags laid out the same way (padding
    entries `PADDING_TAG`) against `pool_tags[page]`, and returns every entry that differs (empty when
    all match). It reads nothing but tags and runs before the model touches the cache.
    """

    enabled: bool

    def check(
        self, pool_tags: torch.Tensor, page_table: Sequence[int], width: int, expected_tags: Sequence[int]
    ) -> list[PageTagMismatch]: ...


class NoPageTagCheck:
    """Checking off: nothing is compared (the engine sends no expected tags either)."""

    enabled = False

    def check(
        self, pool_tags: torch.Tensor, page_table: Sequence[int], width: int, expected_tags: Sequence[int]
    ) -> list[PageTagMismatch]:
        return []


class BatchedPageTagCheck:
    """One batched comparison per step, one call over the whole step: `pool_tags[page_table] != expected`.

    On the CPU, one compiled call (`cpu_kernels.check_page_tags_kernel`) walks the step's two int lists and
    reads the pool's tags in place. The check runs right after the previous step's forward has evicted
    everything else from the caches, and there any library code path runs cold: the NumPy version (array
    from the lists, a view of the tags, gather, two compares, `any`) took ~110-150 us inside the step loop
    at batch 1 against ~12 us back to back, ~1.5% of a decode step; torch ops cost more still. Until the
    kernels are built (or with `HEARTH_CPU_KERNELS=0`) the NumPy version serves. On an accelerator the
    page table and the expected tags cross to the device in one pinned tensor and the answer is read back
    with one synchronization per step (the rows that fail must be known before the model writes their KV:
    a failing row's slots may now belong to another request).
    """

    enabled = True

    def check(
        self, pool_tags: torch.Tensor, page_table: Sequence[int], width: int, expected_tags: Sequence[int]
    ) -> list[PageTagMismatch]:
        num_entries = len(page_table)
        if not num_entries or not expected_tags:  # a step built with checking off carries no tags
            return []
        if len(expected_tags) != num_entries:
            raise ValueError(
                f"the step has {num_entries} page table entries but {len(expected_tags)} expected tags"
            )
        if pool_tags.device.type == "cpu":
            kernel = cpu_kernels.check_page_tags_kernel()
            if kernel is not None and type(page_table) is list and type(expected_tags) is list:
                bad_entries = kernel(pool_tags, page_table, expected_tags, PADDING_TAG)
                if not bad_entries:
                    return []
                return _describe_entries(bad_entries, pool_tags, page_table, expected_tags, width)
            packed = np.array((page_table, expected_tags), dtype=np.int64)
            pages, expected = packed[0], packed[1]
            found = pool_tags.numpy()[pages]
            bad = (found != expected) & (expected != PADDING_TAG)
            if not bad.any():
                return []
            return _describe(bad, pages, expected, found, width)
        packed_tensor = torch.tensor([*page_table, *expected_tags], dtype=torch.long)
        device = pool_tags.device
        if device.type == "cuda":  # pinned, so the copy is asynchronous
            packed_tensor = packed_tensor.pin_memory().to(device, non_blocking=True)
        else:
            packed_tensor = packed_tensor.to(device)
        on_device, expected_on_device = packed_tensor[:num_entries], packed_tensor[num_entries:]
        found_on_device = pool_tags.index_select(0, on_device)
        bad_on_device = (found_on_device != expected_on_device) & (expected_on_device != PADDING_TAG)
        if not bool(bad_on_device.any()):
            return []
        return _describe(
            bad_on_device.cpu().numpy(),
            on_device.cpu().numpy(),
            expected_on_device.cpu().numpy(),
            found_on_device.cpu().numpy(),
            width,
        )


def _describe(
    bad: np.ndarray, pages: np.ndarray, expected: np.ndarray, found: np.ndarray, width: int
) -> list[PageTagMismatch]:
    """The failing entries, for the engine's log and its decision (only on the failure path)."""
    index = np.flatnonzero(bad)
    rows = zip(
        index.tolist(),
        pages[index].tolist(),
        expected[index].tolist(),
        found[index].tolist(),
        strict=True,
    )
    return [
        PageTagMismatch(flat // width, flat % width, page_id, want, have)
        for flat, page_id, want, have in rows
    ]


def _describe_entries(
    bad_entries: list[int],
    pool_tags: torch.Tensor,
    page_table: Sequence[int],
    expected_tags: Sequence[int],
    width: int,
) -> list[PageTagMismatch]:
    """The failing entries the compiled check found (flat indices), for the engine's log and decision."""
    num_pages = pool_tags.shape[0]
    mismatches = []
    for flat in bad_entries:
        page_id = page_table[flat]
        found = int(pool_tags[page_id]) if 0 <= page_id < num_pages else PADDING_TAG
        mismatches.append(PageTagMismatch(flat // width, flat % width, page_id, expected_tags[flat], found))
    return mismatches


def make_page_tag_check(enabled: bool) -> PageTagCheck:
    return BatchedPageTagCheck() if enabled else NoPageTagCheck()


# ---- where pages cross a boundary (PD transfer, host/disk/cluster tiers) --------------------------------
#
# The sender or writer checksums each page's bytes as `KVPool.read_pages` lays them out; the receiver or
# reader verifies them before `write_pages` and recomputes the pages that fail. The receiver also writes only
# into pages that still carry the tags they had when the load was started (`KVLoad.page_generations`): a
# load that arrives after its request was aborted, and its pages handed to someone else, is dropped.


class StalePageError(RuntimeError):
    """A load's destination pages were handed to another request (their tags changed) before it landed."""


def page_checksums(pages: torch.Tensor) -> list[int]:
    """One xxh3-64 per page of a `read_pages` tensor `[num_layers, 2, num_pages, ...]` (every layer's K and V)."""
    from hearth.kv.checksum import page_checksum

    by_page = pages.movedim(2, 0)
    return [page_checksum(by_page[index]) for index in range(by_page.shape[0])]


def failing_pages(pages: torch.Tensor, checksums: Sequence[int]) -> list[int]:
    """Indices (along the page dimension) of the pages whose bytes do not match their writer's checksums."""
    found = page_checksums(pages)
    if len(found) != len(checksums):
        raise ValueError(f"{len(found)} pages but {len(checksums)} checksums")
    return [index for index, (have, want) in enumerate(zip(found, checksums, strict=True)) if have != want]


def check_destination_tags(pool_tags: torch.Tensor, page_ids: Sequence[int], tags: Sequence[int]) -> None:
    """Raise `StalePageError` unless every destination page still carries the tag recorded for the load."""
    if not page_ids:
        return
    found = pool_tags.index_select(0, torch.tensor(list(page_ids), dtype=torch.long).to(pool_tags.device))
    expected = torch.tensor(list(tags), dtype=torch.long).to(pool_tags.device)
    if not bool(torch.equal(found, expected)):
        raise StalePageError(
            f"pages {list(page_ids)} now carry tags {found.tolist()}, the load was for {list(tags)}: dropped"
        )
