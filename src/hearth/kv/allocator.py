"""The page allocator: reference counts and a generation tag per physical page. Plain Python, no tensors."""

from __future__ import annotations

from collections import deque


class OutOfPagesError(RuntimeError):
    pass


class PageAllocator:
    """Hands out physical page ids.

    Contract: `allocate` returns a page with reference count 1 and a generation tag different from
    every earlier holder's, so a reader holding (page id, tag) can tell that the page was reused.
    Tags come from one counter for the whole pool, not one per page: no two allocations ever share a
    tag, so a page table entry that points at the wrong page (two entries swapped, a stale id) is caught
    by the same comparison as a reused page. Tags start at 1; 0 means "never handed out".
    `decref` returns True when the count reaches zero; the caller (the KV cache manager) decides
    whether the page is kept for prefix reuse (`park`) or handed back to the free list (`release`).
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError("the KV pool needs at least one page")
        self.num_pages = num_pages
        self.ref_counts = [0] * num_pages
        self.generations = [0] * num_pages
        self._last_tag = 0
        self._free: deque[int] = deque(range(num_pages))

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise OutOfPagesError("no free KV pages")
        page_id = self._free.popleft()
        self.ref_counts[page_id] = 1
        self._last_tag += 1
        self.generations[page_id] = self._last_tag
        return page_id

    def incref(self, page_id: int) -> None:
        self.ref_counts[page_id] += 1

    def decref(self, page_id: int) -> bool:
        count = self.ref_counts[page_id]
        if count <= 0:
            raise RuntimeError(f"page {page_id} released more often than it was taken")
        self.ref_counts[page_id] = count - 1
        return count == 1

    def reclaim(self, page_id: int) -> None:
        """Fault injection only (`hearth.kv.faults`): the page goes to the head of the free list while its
        holders still list it, as a reference-counting bug would do; the next allocation hands it out."""
        self.ref_counts[page_id] = 0
        self._free.appendleft(page_id)

    def release(self, page_id: int) -> None:
        """Return an unreferenced page to the free list."""
        assert self.ref_counts[page_id] == 0, f"page {page_id} still referenced"
        self._free.append(page_id)
