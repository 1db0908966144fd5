"""Host RAM: the first tier under the device. Evicted device pages land here instead of vanishing.

Pages are kept as CPU tensors (no encoding: the memory is this process's own), bounded by bytes, LRU.
What falls out is handed back to the caller, who spills it to the next tier (disk) if that has room.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from hearth.kv.tiers.base import KVTier, Page
from hearth.kv.tiers.page_format import PageSpec


class HostTier(KVTier):
    name = "host"

    def __init__(self, spec: PageSpec, capacity_bytes: int) -> None:
        super().__init__(spec)
        self.capacity_pages = capacity_bytes // spec.page_bytes
        if self.capacity_pages < 1:
            raise ValueError(
                f"--kv-offload-memory of {capacity_bytes} bytes holds no page of {spec.page_bytes} bytes"
            )
        self._pages: OrderedDict[bytes, Page] = OrderedDict()
        self._lock = threading.Lock()  # the engine thread puts, the loader thread reads

    def lookup(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            found = 0
            for key in keys:
                if key not in self._pages:
                    break
                found += 1
            return found

    def load(self, keys: Sequence[bytes]) -> list[Page]:
        pages: list[Page] = []
        with self._lock:
            for key in keys:
                page = self._pages.get(key)
                if page is None:
                    break
                self._pages.move_to_end(key)
                pages.append(page)
        return pages

    def store(self, items: Sequence[tuple[bytes, Page]]) -> None:
        self.put(items)

    def put(self, items: Sequence[tuple[bytes, Page]]) -> list[tuple[bytes, Page]]:
        """Keep the pages; returns the (key, page) pairs pushed out to make room, oldest first."""
        spilled: list[tuple[bytes, Page]] = []
        with self._lock:
            for key, page in items:
                self._pages[key] = page
                self._pages.move_to_end(key)
            while len(self._pages) > self.capacity_pages:
                spilled.append(self._pages.popitem(last=False))
        return spilled

    def knows(self, key: bytes) -> bool:
        with self._lock:
            return key in self._pages

    def usage(self) -> tuple[int, int]:
        with self._lock:
            count = len(self._pages)
        return count, count * self.spec.page_bytes
