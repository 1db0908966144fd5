"""The KV cache manager: which pages each request holds, prefix reuse, and page accounting.

Plain Python over the allocator and the prefix cache; the scheduler is its only caller. A request
is described by `PageHolder` (its page list and token counts) so this layer knows nothing of the
engine's request objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from hearth.kv.allocator import PageAllocator
from hearth.kv.prefix_cache import PrefixCache
from hearth.kv.prefix_keys import page_keys


class PageHolder(Protocol):
    page_ids: list[int]
    page_generations: list[int]
    num_computed_tokens: int
    cached_page_count: int  # leading pages already registered in the prefix cache

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
    allocator: PageAllocator = field(init=False)
    prefix_cache: PrefixCache = field(init=False)
    stats: PrefixStats = field(default_factory=PrefixStats)

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

    def match_prefix(self, holder: PageHolder, num_prompt_tokens: int) -> int:
        """Attach the longest cached prefix of the prompt to a holder with no pages; returns cached tokens.

        At least one prompt token is always left to compute, since its logits start the answer.
        """
        assert not holder.page_ids
        if not self.enable_prefix_caching:
            return 0
        tokens = holder.all_token_ids[:num_prompt_tokens]
        keys = page_keys(holder.prefix_root, tokens, self.page_size)
        pages = self.prefix_cache.match(keys)
        if len(pages) * self.page_size >= num_prompt_tokens:
            pages = pages[:-1]
        self.stats.queried_tokens += num_prompt_tokens
        self.stats.hit_tokens += len(pages) * self.page_size
        for page_id in pages:
            if self.allocator.ref_counts[page_id] == 0:
                self.prefix_cache.unpark(page_id)
            self.allocator.incref(page_id)
            holder.page_ids.append(page_id)
            holder.page_generations.append(self.allocator.generations[page_id])
        holder.num_computed_tokens = len(pages) * self.page_size
        holder.cached_page_count = len(pages)
        return holder.num_computed_tokens

    def allocate_slots(self, holder: PageHolder, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more tokens; all or nothing."""
        num_needed = self.pages_needed(holder.num_computed_tokens + num_new_tokens) - len(holder.page_ids)
        if num_needed <= 0:
            return True
        if num_needed > self.num_available_pages:
            return False
        for _ in range(num_needed):
            if self.allocator.num_free_pages == 0:
                evicted = self.prefix_cache.evict_one()
                assert evicted is not None
                self.allocator.release(evicted)
            page_id = self.allocator.allocate()
            holder.page_ids.append(page_id)
            holder.page_generations.append(self.allocator.generations[page_id])
        return True

    def cache_full_pages(self, holder: PageHolder) -> None:
        """Name every page that became full of computed tokens, so later requests can reuse it."""
        if not self.enable_prefix_caching:
            return
        num_full = holder.num_computed_tokens // self.page_size
        if num_full <= holder.cached_page_count:
            return
        tokens = holder.all_token_ids[: num_full * self.page_size]
        keys = page_keys(holder.prefix_root, tokens, self.page_size)
        for index in range(holder.cached_page_count, num_full):
            self.prefix_cache.insert(keys[index], holder.page_ids[index])
        holder.cached_page_count = num_full

    def free(self, holder: PageHolder) -> None:
        """Drop every page the holder has; cached pages stay resident until evicted."""
        # Reverse order parks a request's tail before its head, so eviction takes tails first.
        for page_id in reversed(holder.page_ids):
            if self.allocator.decref(page_id):
                if self.prefix_cache.is_cached(page_id):
                    self.prefix_cache.park(page_id)
                else:
                    self.allocator.release(page_id)
        holder.page_ids.clear()
        holder.page_generations.clear()
        holder.num_computed_tokens = 0
        holder.cached_page_count = 0

    def reset_prefix_cache(self) -> None:
        for page_id in self.prefix_cache.clear_parked():
            self.allocator.release(page_id)
