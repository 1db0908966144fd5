"""The prefix cache: full pages named by their prefix key, shared by reference count, evicted LRU.

Plain Python. A cached page with no readers stays resident ("parked") until the allocator runs dry,
then the least recently used parked page is evicted and reused.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PrefixCache:
    """Maps prefix keys to resident pages.

    Contract: `match` returns the pages of the longest run of leading keys that are resident;
    `insert` names a just-filled page (first writer wins: a key already present keeps its page);
    `park` records that a cached page lost its last reader (it becomes evictable, most recent last);
    `unpark` takes it back when a request reuses it; `evict_lru` forgets the least recently used
    parked page and returns its id for reuse with its key (`evict_one`: the id only); `remove` and
    `forget_page` drop a name whose page is suspect (KV integrity), parked or not.
    """

    def __init__(self) -> None:
        self._page_by_key: dict[bytes, int] = {}
        self._key_by_page: dict[int, bytes] = {}
        self._parked: OrderedDict[int, None] = OrderedDict()

    @property
    def num_cached_pages(self) -> int:
        return len(self._page_by_key)

    @property
    def num_parked_pages(self) -> int:
        return len(self._parked)

    def match(self, keys: Sequence[bytes]) -> list[int]:
        pages: list[int] = []
        for key in keys:
            page_id = self._page_by_key.get(key)
            if page_id is None:
                break
            pages.append(page_id)
        return pages

    def is_cached(self, page_id: int) -> bool:
        return page_id in self._key_by_page

    def insert(self, key: bytes, page_id: int) -> bool:
        if key in self._page_by_key or page_id in self._key_by_page:
            return False
        self._page_by_key[key] = page_id
        self._key_by_page[page_id] = key
        return True

    def park(self, page_id: int) -> None:
        self._parked[page_id] = None
        self._parked.move_to_end(page_id)

    def is_parked(self, page_id: int) -> bool:
        return page_id in self._parked

    def unpark(self, page_id: int) -> None:
        self._parked.pop(page_id, None)

    def remove(self, key: bytes) -> int | None:
        """Forget a key (its page is suspect); returns the page it named, None if it named none."""
        page_id = self._page_by_key.pop(key, None)
        if page_id is not None:
            del self._key_by_page[page_id]
            self._parked.pop(page_id, None)
        return page_id

    def forget_page(self, page_id: int) -> None:
        """Forget whatever key names `page_id`."""
        key = self._key_by_page.get(page_id)
        if key is not None:
            self.remove(key)

    def evict_lru(self) -> tuple[int, bytes] | None:
        """Forget the least recently used parked page; returns it with the key it was cached under."""
        if not self._parked:
            return None
        page_id, _ = self._parked.popitem(last=False)
        key = self._key_by_page.pop(page_id)
        del self._page_by_key[key]
        return page_id, key

    def evict_one(self) -> int | None:
        evicted = self.evict_lru()
        return evicted[0] if evicted is not None else None

    def clear_parked(self) -> list[int]:
        """Forget every parked page (e.g. a cache reset); returns their ids."""
        pages = []
        while (page_id := self.evict_one()) is not None:
            pages.append(page_id)
        return pages
