"""The tier interface: a place below device memory that holds KV pages by prefix key.

Contract (every tier):
- `lookup(keys) -> n`: the first n keys are held (as far as the tier knows without reading them).
- `load(keys) -> pages`: the leading pages it could read and validate, in order, as CPU tensors of the
  stack's `PageSpec`; fewer than `lookup` promised is fine (a page evicted or damaged meanwhile: the
  caller recomputes the rest), never a wrong page.
- `store(items)`: keep these (key, page) pairs, evicting what it must; pages it already holds may be
  skipped. A tier never blocks the engine: the stack calls `load`/`store` from its own threads.
- `knows(key)`: this process knows the tier holds the key, answered from local memory (no I/O), so a
  write-back can skip pages already there.
- `local`: lookups need no network (host RAM, local disk); a remote tier's may raise `TierUnavailable`
  (down, timed out), as may its `load`/`store`; the stack then stops asking it for a while.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence

import torch

from hearth.kv.tiers.blob_auth import BlobMAC
from hearth.kv.tiers.page_format import PageFormatError, PageSpec, decode_page, encode_page
from hearth.kv.tiers.stats import TierStats, TierStatsRecorder

Page = torch.Tensor  # one page, CPU, PageSpec.shape and dtype


class TierUnavailable(RuntimeError):
    """The tier cannot be reached now (connection refused, timed out); callers recompute."""


class KVTier(ABC):
    name: str = "tier"
    local: bool = True

    def __init__(self, spec: PageSpec) -> None:
        self.spec = spec
        self.stats = TierStatsRecorder(self.name)

    @abstractmethod
    def lookup(self, keys: Sequence[bytes]) -> int: ...

    @abstractmethod
    def load(self, keys: Sequence[bytes]) -> list[Page]: ...

    @abstractmethod
    def store(self, items: Sequence[tuple[bytes, Page]]) -> None: ...

    @abstractmethod
    def knows(self, key: bytes) -> bool: ...

    def usage(self) -> tuple[int, int]:
        """(pages, bytes) this process knows the tier holds; (-1, -1) when it cannot know (shared store)."""
        return -1, -1

    def unavailable(self) -> None:  # noqa: B027 - optional hook
        """The tier just failed: forget what we believed it holds (it may come back empty)."""

    def snapshot(self) -> TierStats:
        return self.stats.snapshot(*self.usage())

    def close(self) -> None:  # noqa: B027 - optional hook
        pass


class KnownKeys:
    """A bounded LRU set of keys a remote store is believed to hold (written or seen by this process)."""

    def __init__(self, capacity: int = 1 << 20) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def __contains__(self, key: bytes) -> bool:
        return key in self._keys

    def add(self, key: bytes) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)
        if len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def clear(self) -> None:
        self._keys.clear()


class BlobStoreTier(KVTier):
    """A remote key-value store of encoded page blobs (`page_format`); subclasses move bytes only.

    Subclasses implement `_exists(names) -> list[bool]`, `_get(names) -> list[bytes | None]` and
    `_put(pairs)`, raising `TierUnavailable` when the store cannot be reached. Every blob carries a MAC
    under the deployment secret (`blob_auth`): `mac` must be set before use (`open_store` does), since
    anyone who can reach the store can write to it.
    """

    local = False

    def __init__(self, spec: PageSpec, prefix: str = "hearth:kv:") -> None:
        super().__init__(spec)
        self.prefix = prefix
        self._known = KnownKeys()
        self.mac: BlobMAC | None = None

    def _blob_mac(self) -> BlobMAC:
        if self.mac is None:
            raise TierUnavailable(f"{self.name}: no deployment secret to authenticate its blobs with")
        return self.mac

    def object_name(self, key: bytes) -> str:
        return self.prefix + key.hex()

    @abstractmethod
    def _exists(self, names: list[str]) -> list[bool]: ...

    @abstractmethod
    def _get(self, names: list[str]) -> list[bytes | None]: ...

    @abstractmethod
    def _put(self, pairs: list[tuple[str, bytes]]) -> None: ...

    def lookup(self, keys: Sequence[bytes]) -> int:
        found = 0
        for key, held in zip(keys, self._exists([self.object_name(k) for k in keys]), strict=True):
            if not held:
                break
            self._known.add(key)
            found += 1
        return found

    def load(self, keys: Sequence[bytes]) -> list[Page]:
        mac = self._blob_mac()
        pages: list[Page] = []
        for key, blob in zip(keys, self._get([self.object_name(k) for k in keys]), strict=True):
            if blob is None:
                break
            try:
                pages.append(decode_page(self.spec, key, mac.open(key, blob)))
            except PageFormatError:
                self.stats.add(invalid_pages=1)
                break
        return pages

    def store(self, items: Sequence[tuple[bytes, Page]]) -> None:
        mac = self._blob_mac()
        self._put(
            [(self.object_name(key), mac.seal(key, encode_page(self.spec, key, page))) for key, page in items]
        )
        for key, _ in items:
            self._known.add(key)

    def knows(self, key: bytes) -> bool:
        return key in self._known

    def unavailable(self) -> None:
        self._known.clear()
