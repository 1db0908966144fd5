from dataclasses import dataclass, field

from hearth.kv.manager import KVCacheManager
from hearth.kv.prefix_cache import PrefixCache
from hearth.kv.prefix_keys import page_keys, root_key


@dataclass
class Holder:
    tokens: list[int]
    root: bytes = field(default_factory=lambda: root_key("m"))
    page_ids: list[int] = field(default_factory=list)
    page_generations: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    cached_page_count: int = 0

    @property
    def all_token_ids(self):
        return self.tokens

    @property
    def prefix_root(self):
        return self.root


def compute(manager: KVCacheManager, holder: Holder) -> int:
    cached = manager.match_prefix(holder, len(holder.tokens))
    assert manager.allocate_slots(holder, len(holder.tokens) - holder.num_computed_tokens)
    holder.num_computed_tokens = len(holder.tokens)
    manager.cache_full_pages(holder)
    return cached


def test_keys_chain_and_depend_on_salt():
    root_a, root_b = root_key("m", "fp32", "a"), root_key("m", "fp32", "b")
    tokens = list(range(10))
    keys = page_keys(root_a, tokens, 4)
    assert len(keys) == 2  # the partial third page has no key
    assert keys != page_keys(root_b, tokens, 4)
    assert page_keys(root_a, [99] + tokens[1:], 4)[1] != keys[1]  # a change upstream changes every later key


def test_lru_eviction_order():
    cache = PrefixCache()
    for page in range(3):
        cache.insert(bytes([page]), page)
    cache.park(1)
    cache.park(0)
    cache.park(2)
    cache.unpark(0)
    cache.park(0)  # 0 is now the most recently used
    assert [cache.evict_one(), cache.evict_one(), cache.evict_one()] == [1, 2, 0]
    assert cache.evict_one() is None
    assert cache.match([bytes([1])]) == []


def test_shared_prefix_is_reused_and_refcounts_return_to_zero():
    manager = KVCacheManager(num_pages=8, page_size=4)
    first = Holder(list(range(10)))
    assert compute(manager, first) == 0
    second = Holder(list(range(8)) + [50, 51, 52])
    assert compute(manager, second) == 8
    assert second.page_ids[:2] == first.page_ids[:2]
    assert manager.allocator.ref_counts[first.page_ids[0]] == 2
    manager.free(first)
    manager.free(second)
    assert all(count == 0 for count in manager.allocator.ref_counts)
    assert manager.num_used_pages == 0
    assert manager.stats.hit_tokens == 8


def test_fully_cached_prompt_leaves_its_last_page_to_compute():
    manager = KVCacheManager(num_pages=8, page_size=4)
    compute(manager, Holder(list(range(8))))
    again = Holder(list(range(8)))
    assert manager.match_prefix(again, 8) == 4


def test_eviction_frees_parked_pages_under_pressure_and_tags_change():
    manager = KVCacheManager(num_pages=3, page_size=2)
    first = Holder([1, 2, 3, 4, 5, 6])
    compute(manager, first)
    old = list(zip(first.page_ids, first.page_generations))
    manager.free(first)
    assert manager.prefix_cache.num_parked_pages == 3
    other = Holder([9, 9, 8, 8, 7, 7])
    assert compute(manager, other) == 0  # every parked page was evicted to make room
    new = dict(zip(other.page_ids, other.page_generations))
    assert all(new[page] != tag for page, tag in old)
    assert manager.match_prefix(Holder([1, 2, 3, 4, 5, 6]), 6) == 0


def test_allocation_is_all_or_nothing():
    manager = KVCacheManager(num_pages=2, page_size=2)
    holder = Holder(list(range(6)))
    assert not manager.allocate_slots(holder, 6)
    assert holder.page_ids == [] and manager.num_used_pages == 0


def test_disabled_prefix_caching_never_matches():
    manager = KVCacheManager(num_pages=8, page_size=4, enable_prefix_caching=False)
    compute(manager, Holder(list(range(10))))
    assert manager.match_prefix(Holder(list(range(10))), 10) == 0
