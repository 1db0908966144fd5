"""An approximate prefix index per worker: which prompt pages the router believes each worker holds.

Keys are hash chains, so key i stands for the whole prefix up to block i. With token ids the
keys are the engine's own page keys (`hearth.kv.prefix_keys`); without them, a chain over
fixed-size character blocks stands in. The index is bounded and forgets least recently used
blocks first, as the worker's cache does.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence

from hearth.kv.prefix_keys import KEY_BYTES, page_keys, root_key
from hearth.router.tokens import CHARS_PER_TOKEN


class PrefixKeyer(ABC):
    """Turns a prompt into the hash-chain keys of its full blocks.

    Contract: equal prefixes give equal leading keys; each key stands for `tokens_per_key` tokens.
    """

    tokens_per_key: int

    @abstractmethod
    def keys(self, text: str, token_ids: Sequence[int] | None, tenant: str | None) -> list[bytes]: ...


class TokenPageKeyer(PrefixKeyer):
    """The engine's page keys over token ids; falls back to char blocks when ids are missing."""

    def __init__(self, model_id: str, page_size: int) -> None:
        self.model_id = model_id
        self.tokens_per_key = page_size
        self._chars = CharBlockKeyer(block_chars=page_size * CHARS_PER_TOKEN)

    def keys(self, text: str, token_ids: Sequence[int] | None, tenant: str | None) -> list[bytes]:
        if token_ids is None:
            return self._chars.keys(text, None, tenant)
        return page_keys(root_key(self.model_id, "router", tenant), token_ids, self.tokens_per_key)


class CharBlockKeyer(PrefixKeyer):
    def __init__(self, block_chars: int = 256) -> None:
        self.block_chars = block_chars
        self.tokens_per_key = max(1, block_chars // CHARS_PER_TOKEN)

    def keys(self, text: str, token_ids: Sequence[int] | None, tenant: str | None) -> list[bytes]:
        parent = root_key("router-chars", str(self.block_chars), tenant)
        data = text.encode()
        keys: list[bytes] = []
        block = self.block_chars
        for start in range(0, len(data) - block + 1, block):
            parent = hashlib.blake2b(parent + data[start : start + block], digest_size=KEY_BYTES).digest()
            keys.append(parent)
        return keys


class PrefixIndex:
    """The blocks one worker is believed to hold, bounded, least recently used evicted first."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks <= 0:
            raise ValueError("prefix index capacity must be positive")
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match_blocks(self, keys: Sequence[bytes]) -> int:
        """How many leading keys are present (a chain key implies its whole prefix)."""
        blocks = self._blocks
        # Probe from the end first: agents re-send a prefix that is usually entirely cached.
        if keys and keys[-1] in blocks:
            return len(keys)
        matched = 0
        for key in keys:
            if key not in blocks:
                break
            matched += 1
        return matched

    def insert(self, keys: Sequence[bytes]) -> None:
        blocks = self._blocks
        # Tail first, so a prefix's head is the most recent: leaves are forgotten before their root.
        for key in reversed(keys):
            if key in blocks:
                blocks.move_to_end(key)
            else:
                blocks[key] = None
        while len(blocks) > self.capacity_blocks:
            blocks.popitem(last=False)

    def clear(self) -> None:
        self._blocks.clear()
