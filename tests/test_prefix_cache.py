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
    page_keys: list[bytes] = field(default_factory=list)

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


def test_page_keys_are_hashed_once_per_page_as_a_request_grows(monkeypatch):
    import hearth.kv.prefix_keys as prefix_keys

    calls = []
    real = prefix_keys.page_key

    def counting(parent: bytes, tokens: list[int]) -> bytes:
        calls.append(1)
        return real(parent, tokens)

    monkeypatch.setattr(prefix_keys, "page_key", counting)
    manager = KVCacheManager(num_pages=64, page_size=4)
    holder = Holder(list(range(10)))
    compute(manager, holder)  # 2 full pages
    assert len(calls) == 2
    for token in range(100, 140):  # decode 40 tokens, one page fills every 4
        holder.tokens.append(token)
        assert manager.allocate_slots(holder, 1)
        holder.num_computed_tokens += 1
        manager.cache_full_pages(holder)
    assert len(calls) == 50 // 4 == len(holder.page_keys)
    manager.free(holder)  # e.g. preempted: the keys describe tokens, not pages, so they are kept
    assert manager.match_prefix(holder, len(holder.tokens)) == 48
    assert len(calls) == 12
    assert holder.page_keys == page_keys(holder.root, holder.tokens, 4)


def test_truncate_frees_pages_past_the_cut():
    manager = KVCacheManager(num_pages=8, page_size=4)
    holder = Holder(list(range(14)))
    assert manager.allocate_slots(holder, 14)
    holder.num_computed_tokens = 14
    tail = holder.page_ids[2:]
    manager.truncate(holder, 7)
    assert len(holder.page_ids) == len(holder.page_generations) == 2 and holder.num_computed_tokens == 7
    assert all(manager.allocator.ref_counts[p] == 0 for p in tail)
    assert manager.allocator.num_free_pages == 6
    manager.truncate(holder, 8)  # nothing past the cut: a no-op
    assert len(holder.page_ids) == 2 and holder.num_computed_tokens == 7
    manager.free(holder)
    assert all(count == 0 for count in manager.allocator.ref_counts)


def test_truncate_never_leaves_a_cached_page_to_be_rewritten():
    manager = KVCacheManager(num_pages=8, page_size=4)
    holder = Holder(list(range(12)))
    compute(manager, holder)  # 3 cached pages
    pages = list(holder.page_ids)
    manager.truncate(holder, 6)  # inside the cached second page: the cut moves to its start
    assert holder.page_ids == pages[:1] and holder.num_computed_tokens == 4 and holder.cached_page_count == 1
    # The dropped pages still hold their full page of tokens, so they stay cached (parked).
    assert manager.prefix_cache.num_parked_pages == 2
    assert manager.match_prefix(Holder(list(range(13))), 13) == 12
    manager.free(holder)


def test_router_keys_use_the_engine_chain_under_their_own_root():
    # The router's index keys (router/prefix_index.py) are the same chain over token ids, salted by
    # model id and tenant like the engine's, but with "router" where the engine puts its KV layout:
    # the router knows neither each worker's layout nor, for chat, the engine's token ids.
    from hearth.router.prefix_index import TokenPageKeyer

    tokens = list(range(9))
    router = TokenPageKeyer("m", 4).keys("", tokens, "tenant")
    assert router == page_keys(root_key("m", "router", "tenant"), tokens, 4)
    assert router != page_keys(root_key("m", "torch.bfloat16/p4/h2x8/l2", "tenant"), tokens, 4)
