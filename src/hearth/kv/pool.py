"""The KV pool: the tensors that hold every layer's keys and values, page by page."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype

    @property
    def bytes_per_page(self) -> int:
        element_bytes = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.page_size * self.num_kv_heads * self.head_dim * element_bytes

    def describe(self) -> str:
        """Part of the prefix-key salt: pages of different layouts never match."""
        return f"{self.dtype}/p{self.page_size}/h{self.num_kv_heads}x{self.head_dim}/l{self.num_layers}"


class KVPool:
    """Per layer, K and V as `[num_pages * page_size, num_kv_heads, head_dim]`: a slot is `page * page_size + offset`.

    Allocated with `torch.empty`, so the operating system commits memory only as pages are written.
    """

    def __init__(self, layout: KVLayout, num_pages: int, device: torch.device | str = "cpu") -> None:
        self.layout = layout
        self.num_pages = num_pages
        num_slots = num_pages * layout.page_size
        shape = (layout.num_layers, 2, num_slots, layout.num_kv_heads, layout.head_dim)
        self.storage = torch.empty(shape, dtype=layout.dtype, device=device)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.storage[index, 0], self.storage[index, 1]

    @staticmethod
    def num_pages_for_budget(layout: KVLayout, memory_bytes: int) -> int:
        return max(0, memory_bytes // layout.bytes_per_page)
