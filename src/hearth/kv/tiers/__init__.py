"""KV cache tiers below device memory: host RAM, local disk, and a cluster-shared store (Redis, Mooncake).

`build_tiers` makes the tiers the options ask for; `TierStack` runs them for the engine (lookups,
spills on eviction, write-back, prefetch on background threads). Pages are named by the prefix-key
chain (`hearth.kv.prefix_keys`), so a key means the same page in every process and on every machine.
"""

from hearth.kv.tiers.base import KVTier, TierUnavailable
from hearth.kv.tiers.page_format import PageFormatError, PageSpec, decode_page, encode_page
from hearth.kv.tiers.registry import KV_STORES, build_tiers, open_store, register_store
from hearth.kv.tiers.stack import TierStack
from hearth.kv.tiers.stats import TierStats

__all__ = [
    "KV_STORES",
    "KVTier",
    "PageFormatError",
    "PageSpec",
    "TierStack",
    "TierStats",
    "TierUnavailable",
    "build_tiers",
    "decode_page",
    "encode_page",
    "open_store",
    "register_store",
]
