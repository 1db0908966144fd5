"""The KV cache manager: which pages each request holds, prefix reuse, and page accounting.

Plain Python over the allocator and the prefix cache; the scheduler is its only caller. A request
is described by `PageHolder` (its page list and token counts) so this layer knows nothing of the
engine's request objects.

Two hooks let a lower cache tier (host RAM, disk, a shared store) sit under the device cache:
`on_evict(key, page_id)` runs before a cached page is evicted and reused, so the tier can copy it
out first; `lookup(keys)` says how many leading keys the tier can supply when the device cache
misses, and the scheduler then allocates pages for them and waits for the KV (`WAITING_FOR_KV`).

Pages are released by (page id, tag): a holder drops only pages that still carry a tag it recorded, so
after a bookkeeping fault (a page freed early and reused, two table entries swapped: see
`hearth.kv.faults`) releasing the victim never takes a reference another request owns. The prefix cache
never names a page whose tag changed: a page coming off the free list loses any name it still has, and a
named page with no readers that is not parked (it was freed under its name) is a miss.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from hearth.kv.allocator import PageAllocator
from hearth.kv.faults import KVFaultInjector
from hearth.kv.prefix_cache import PrefixCache
from hearth.kv.prefix_keys import extend_page_keys

# (key, page_id) of a cached page about to be evicted; its KV is intact until the callback returns.
EvictCallback = Callable[[bytes, int], None]
# Page keys past the device cache's match -> how many of the leading ones a lower tier holds.
LookupHook = Callable[[Sequence[bytes]], int]


class PageHolder(Protocol):
    page_ids: list[int]
    page_generations: list[int]
    num_computed_tokens: int
    cached_page_count: int  # leading pages already offered to the prefix cache
    page_keys: list[bytes]  # keys of the leading full pages of all_token_ids, extended as needed

    @property
    def all_token_ids(self) -> list[int]: ...

    @property
    def prefix_root(self) -> bytes: ...


@dataclass
class PrefixStats:
    queried_tokens: int = 0
    hit_tokens: int = 0


@dataclass
class KVCacheManager:
    num_pages: int
    page_size: int
    enable_prefix_caching: bool = True
    on_evict: EvictCallback | None = None
    lookup: LookupHook | None = None
    allocator: PageAllocator = field(init=False)
    prefix_cache: PrefixCache = field(init=False)
    stats: PrefixStats = field(default_factory=PrefixStats)
    faults: KVFaultInjector | None = None  # HEARTH_KV_FAULTS, tests only
    num_stale_pages: int = 0  # releases skipped because the page was no longer the holder's (a fault)
    # Pages handed out since `take_allocated` and the tags they got: the worker's pool learns tags from here.
    _allocated_page_ids: list[int] = field(default_factory=list)
    _allocated_tags: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.allocator = PageAllocator(self.num_pages)
        self.prefix_cache = PrefixCache()

    @property
    def num_available_pages(self) -> int:
        return self.allocator.num_free_pages + self.prefix_cache.num_parked_pages

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - self.num_available_pages

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def _keys(self, holder: PageHolder, num_pages: int) -> list[bytes]:
        """The holder's first `num_pages` keys, hashing only the pages not keyed yet."""
        keys = holder.page_keys
        if len(keys) < num_pages:
            extend_page_keys(keys, holder.prefix_root, holder.all_token_ids, self.page_size, num_pages)
        return keys

    def match_prefix(self, holder: PageHolder, num_prompt_tokens: int) -> int:
        """Attach the longest cached prefix of the prompt to a holder with no pages; returns cached tokens.

        At least one prompt token is always left to compute, since its logits start the answer.
        """
        assert not holder.page_ids
        if not self.enable_prefix_caching:
            return 0
        num_keys = num_prompt_tokens // self.page_size
        keys = self._keys(holder, num_keys)
        pages = self.prefix_cache.match(keys if len(keys) == num_keys else keys[:num_keys])
        ref_counts = self.allocator.ref_counts
        for index, page_id in enumerate(pages):
            if ref_counts[page_id] == 0 and not self.prefix_cache.is_parked(page_id):
                # Named but on the free list: it was freed under its name (a fault); never read it.
                self.prefix_cache.forget_page(page_id)
                del pages[index:]
                break
        if len(pages) * self.page_size >= num_prompt_tokens:
            pages = pages[:-1]
        self.stats.queried_tokens += num_prompt_tokens
        self.stats.hit_tokens += len(pages) * self.page_size
        for page_id in pages:
            if ref_counts[page_id] == 0:
                self.prefix_cache.unpark(page_id)
            self.allocator.incref(page_id)
            holder.page_ids.append(page_id)
            holder.page_generations.append(self.allocator.generations[page_id])
        holder.num_computed_tokens = len(pages) * self.page_size
        holder.cached_page_count = len(pages)
        return holder.num_computed_tokens

    def match_lower_tier(self, holder: PageHolder, num_prompt_tokens: int) -> int:
        """Prompt tokens right after the holder's pages that the lower tier can supply (whole pages).

        Called after `match_prefix`, where the device cache stopped. Asks `lookup` about the keys of
        the following full pages, leaving at least one prompt token to compute. Allocates nothing:
        the caller allocates the pages (`allocate_slots`) and has the tier load them.
        """
        if self.lookup is None or not self.enable_prefix_caching:
            return 0
        first = len(holder.page_ids)
        assert holder.num_computed_tokens == first * self.page_size, "device matches end on a page boundary"
        last = (num_prompt_tokens - 1) // self.page_size  # pages wholly before the last prompt token
        if last <= first:
            return 0
        found = self.lookup(self._keys(holder, last)[first:last])
        return max(0, min(found, last - first)) * self.page_size

    def allocate_slots(self, holder: PageHolder, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more tokens; all or nothing."""
        num_needed = self.pages_needed(holder.num_computed_tokens + num_new_tokens) - len(holder.page_ids)
        if num_needed <= 0:
            return True
        if num_needed > self.num_available_pages:
            return False
        for _ in range(num_needed):
            if self.allocator.num_free_pages == 0:
                evicted = self.prefix_cache.evict_lru()
                assert evicted is not None
                page_id, key = evicted
                if self.on_evict is not None:
                    self.on_evict(key, page_id)  # before the page is handed out and overwritten
                self.allocator.release(page_id)
            page_id = self.allocator.allocate()
            if self.prefix_cache.is_cached(
                page_id
            ):  # freed under its name (a fault): its KV is about to change
                self.prefix_cache.forget_page(page_id)
            tag = self.allocator.generations[page_id]
            holder.page_ids.append(page_id)
            holder.page_generations.append(tag)
            self._allocated_page_ids.append(page_id)
            self._allocated_tags.append(tag)
            if self.faults is not None:
                self.faults.after_allocation(self)
        return True

    def take_allocated(self) -> tuple[list[int], list[int]]:
        """(page ids, tags) handed out since the last call, in order, for the pool's tag tensor."""
        taken = self._allocated_page_ids, self._allocated_tags
        self._allocated_page_ids, self._allocated_tags = [], []
        return taken

    def cache_full_pages(self, holder: PageHolder) -> None:
        """Name every page that became full of computed tokens, so later requests can reuse it."""
        if not self.enable_prefix_caching:
            return
        num_full = holder.num_computed_tokens // self.page_size
        if num_full <= holder.cached_page_count:
            return
        keys = self._keys(holder, num_full)
        for index in range(holder.cached_page_count, num_full):
            self.prefix_cache.insert(keys[index], holder.page_ids[index])
        holder.cached_page_count = num_full

    def truncate(self, holder: PageHolder, num_tokens: int) -> None:
        """Keep the KV of the holder's first `num_tokens` tokens only: frees the pages past them.

        `num_computed_tokens` is capped at `num_tokens`. A page offered to the prefix cache is never
        rewritten (other requests may read it): if the cut falls inside one, it moves back to that
        page's start. Freed pages that are cached still hold their full page of tokens, so they stay
        cached (parked); the others go back to the free list.
        """
        num_full = num_tokens // self.page_size
        if holder.cached_page_count > num_full:
            num_tokens = num_full * self.page_size
            holder.cached_page_count = num_full
        if holder.num_computed_tokens > num_tokens:
            holder.num_computed_tokens = num_tokens
        keep = self.pages_needed(num_tokens)
        page_ids = holder.page_ids
        if len(page_ids) <= keep:
            return
        generations = self.allocator.generations
        tags = holder.page_generations
        for index in range(len(page_ids) - 1, keep - 1, -1):
            page_id = page_ids[index]
            if generations[page_id] == tags[index]:
                self._drop(page_id)
            else:
                self.num_stale_pages += 1
        del page_ids[keep:]
        del tags[keep:]

    def free(self, holder: PageHolder) -> None:
        """Drop every page the holder has; cached pages stay resident until evicted."""
        page_ids, tags = holder.page_ids, holder.page_generations
        generations = self.allocator.generations
        if all(generations[page_id] == tag for page_id, tag in zip(page_ids, tags, strict=True)):
            # Reverse order parks a request's tail before its head, so eviction takes tails first.
            for page_id in reversed(page_ids):
                self._drop(page_id)
        else:
            self._free_mismatched(page_ids, tags)
        page_ids.clear()
        tags.clear()
        holder.num_computed_tokens = 0
        holder.cached_page_count = 0

    def _free_mismatched(self, page_ids: list[int], tags: list[int]) -> None:
        """A table that no longer matches its tags (entries swapped, pages reused): drop each page once if
        it still carries one of the holder's tags (tags are unique, so then it is the holder's), else skip it."""
        expected = set(tags)
        generations = self.allocator.generations
        for page_id in reversed(list(dict.fromkeys(page_ids))):
            if generations[page_id] in expected:
                self._drop(page_id)
            else:
                self.num_stale_pages += 1
        self.num_stale_pages += len(page_ids) - len(set(page_ids))

    def forget_cached_pages(self, holder: PageHolder, page_indices: list[int]) -> None:
        """The prefix cache stops naming the holder's logical pages `page_indices` (they failed the
        integrity check): whatever page their keys name now is never handed to another request."""
        keys = holder.page_keys
        cache = self.prefix_cache
        for index in page_indices:
            if index >= len(keys):
                continue
            named = cache.match([keys[index]])
            if named:
                parked = cache.is_parked(named[0])
                cache.remove(keys[index])
                if parked:
                    self.allocator.release(named[0])  # nobody reads it: back to the free list

    def _drop(self, page_id: int) -> None:
        if self.allocator.ref_counts[page_id] == 0:
            self.num_stale_pages += 1  # freed early under its holders (a fault): already back in the pool
            return
        if self.allocator.decref(page_id):
            if self.prefix_cache.is_cached(page_id):
                self.prefix_cache.park(page_id)
            else:
                self.allocator.release(page_id)

    def hold_pages(self, page_ids: list[int]) -> None:
        """An extra reference on pages a holder has (a PD send reads them after the request ends)."""
        for page_id in page_ids:
            self.allocator.incref(page_id)

    def release_pages(self, page_ids: list[int]) -> None:
        """Drop references taken by `hold_pages`."""
        for page_id in reversed(page_ids):
            self._drop(page_id)

    def reset_prefix_cache(self) -> None:
        for page_id in self.prefix_cache.clear_parked():
            self.allocator.release(page_id)
