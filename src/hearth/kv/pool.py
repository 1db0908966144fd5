"""The KV pool: the tensors that hold every layer's keys and values, page by page, on one device.

A physical page id indexes the pool of every layer. Besides K and V the pool keeps one generation
tag per page (written by the engine when the allocator hands a page out, read by the integrity
check) and, for quantized KV dtypes, per-layer scales.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from hearth.kv.dtypes import KVCacheDtypeError, check_kv_cache_dtype
from hearth.kv.page_io import PageIO, PageLayout, paged_view
from hearth.ops.attention.backend import as_copyable, write_kv
from hearth.ops.fp8 import FP8_DTYPE, is_fp8, quantize_fp8

__all__ = ["KVCacheDtypeError", "KVLayout", "KVPool", "resolve_kv_dtype"]

KVKind = Literal["mha", "latent"]
_NAMED_KV_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "fp8_e4m3": FP8_DTYPE,
}


def resolve_kv_dtype(requested: str, model_dtype: torch.dtype) -> torch.dtype:
    """`--kv-cache-dtype`: `auto` stores K/V in the model's dtype; the others name the storage dtype."""
    if requested == "auto":
        return model_dtype
    check_kv_cache_dtype(requested)
    return _NAMED_KV_DTYPES[requested]


@dataclass(frozen=True)
class KVLayout:
    """What a page holds. `kv_dtype` is the storage dtype (it may differ from the model's compute dtype);
    `kind` is "mha" (K and V per KV head) or "latent" (MLA models: per token one vector of `head_dim`
    values, the compressed KV latent and the rotated key shared by all heads; `num_kv_heads` is 1)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    kv_dtype: torch.dtype
    kind: KVKind = "mha"

    def __post_init__(self) -> None:
        if self.kind == "latent" and self.num_kv_heads != 1:
            raise ValueError(f"a latent KV layout holds one vector per token, not {self.num_kv_heads} heads")

    @property
    def num_planes(self) -> int:
        """Tensors per layer: K and V for "mha"; the latent alone (keys and values both read it) for "latent"."""
        return 1 if self.kind == "latent" else 2

    @property
    def bytes_per_token(self) -> int:
        """Pool bytes one token takes, over all layers."""
        element_bytes = torch.empty((), dtype=self.kv_dtype).element_size()
        return self.num_planes * self.num_layers * self.num_kv_heads * self.head_dim * element_bytes

    @property
    def bytes_per_page(self) -> int:
        return self.page_size * self.bytes_per_token

    def describe(self) -> str:
        """Part of the prefix-key salt: pages of different layouts (dtype included) never match."""
        dtype = str(self.kv_dtype).removeprefix("torch.")
        return (
            f"{self.kind}/{dtype}/p{self.page_size}/h{self.num_kv_heads}x{self.head_dim}/l{self.num_layers}"
        )


class KVPool:
    """Per layer, K and V as `[num_pages * page_size, num_kv_heads, head_dim]`: a slot is `page * page_size + offset`.
    A "latent" layout keeps one such tensor per layer (`num_kv_heads` 1), which serves as both K and V.

    Contract:
    - `layer(i)` gives layer i's (K, V) slot-addressed views; attention backends read them in place. For a
      latent layout both are the same tensor: MLA attends with the latent as keys and as values.
    - `store(layer, slot_mapping, k, v)` writes a step's new keys and values (converted to `kv_dtype`);
      for a latent layout `k` is the latent and `v` is None.
    - `read_pages(page_ids)` copies whole pages of every layer out, `[num_layers, num_planes, len(page_ids),
      page_size, num_kv_heads, head_dim]` in `kv_dtype` (`num_planes` 2, or 1 for a latent layout), and `write_pages(page_ids, data)` puts such a
      tensor (any float dtype, any device: converted on the way) into other pages, of this pool or another
      one of the same shape: transfer between servers and tiers moves pages this way.
    - `page_tags[page]` (int64, on the pool's device) is the generation tag the allocator gave the page's
      current holder; `set_page_tags` writes them as pages are handed out, the integrity check reads them.
    - `k_scales`/`v_scales` (float32 `[num_layers, num_kv_heads]`) are None for unquantized dtypes. An FP8
      pool refuses to store until `set_scales` gave it measured ones (`hearth.engine.fp8_kv_scales`); `store`
      divides by them, readers multiply (`kv_scales(layer)`); `read_pages`/`write_pages` move the stored
      values as they are (`hearth.kv.convert` converts between pools of different dtypes).

    Allocated with `torch.empty`, so on CPU the operating system commits memory only as pages are written.
    """

    def __init__(
        self,
        layout: KVLayout,
        num_pages: int,
        device: torch.device | str = "cpu",
        page_layout: PageLayout | None = None,
    ) -> None:
        self.layout = layout
        self.num_pages = num_pages
        self.page_size = layout.page_size
        self.device = torch.device(device)
        num_slots = num_pages * layout.page_size
        shape = (layout.num_layers, layout.num_planes, num_slots, layout.num_kv_heads, layout.head_dim)
        self.storage = torch.empty(shape, dtype=layout.kv_dtype, device=self.device)
        self.page_tags = torch.zeros(num_pages, dtype=torch.int64, device=self.device)
        self.k_scales: torch.Tensor | None = None
        self.v_scales: torch.Tensor | None = None
        self._layer_scales: list[tuple[torch.Tensor, torch.Tensor]] = []
        value_plane = 1 if layout.num_planes == 2 else 0
        self._layers = [(self.storage[i, 0], self.storage[i, value_plane]) for i in range(layout.num_layers)]
        # Every read and write of whole pages (transfers, tiers) goes through here; `page_layout` places a
        # rank's shard in the model's KV (layers of its stage, its KV heads).
        self.io = PageIO(self, page_layout)

    @property
    def quantized(self) -> bool:
        return is_fp8(self.layout.kv_dtype)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._layers[index]

    def set_scales(self, k_scales: torch.Tensor, v_scales: torch.Tensor) -> None:
        """Per (layer, KV head) scales of an FP8 pool, float32 `[num_layers, num_kv_heads]`."""
        shape = (self.layout.num_layers, self.layout.num_kv_heads)
        for name, scales in (("k_scales", k_scales), ("v_scales", v_scales)):
            if tuple(scales.shape) != shape:
                raise ValueError(f"{name} has shape {tuple(scales.shape)}, this pool takes {shape}")
            if not bool(torch.isfinite(scales).all()) or not bool((scales > 0).all()):
                raise ValueError(f"{name} must be finite and > 0")
        if self.layout.kind == "latent" and not torch.equal(k_scales, v_scales):
            raise ValueError("a latent pool is read as keys and as values: its K and V scales must be equal")
        self.k_scales = k_scales.to(self.device, torch.float32).contiguous()
        self.v_scales = v_scales.to(self.device, torch.float32).contiguous()
        self._layer_scales = [(self.k_scales[i], self.v_scales[i]) for i in range(shape[0])]

    def kv_scales(self, index: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer `index`'s (K, V) scales `[num_kv_heads]` to multiply stored values by; None when unquantized."""
        if not self.quantized:
            return None
        if self.k_scales is None:
            raise RuntimeError("the FP8 KV pool has no scales yet (set_scales): refusing to use 1.0")
        return self._layer_scales[index]

    def store(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> None:
        """k, v `[num_tokens, num_kv_heads, head_dim]` into the slots `slot_mapping` (long, on the pool's device)."""
        k_pool, v_pool = self._layers[layer]
        scales = self.kv_scales(layer)
        if v is None:  # a latent layout: one tensor (FP8: its K scales, which its V scales equal)
            if scales is not None:
                k = quantize_fp8(k, scales[0])
            as_copyable(k_pool).index_copy_(0, slot_mapping, as_copyable(k.to(k_pool.dtype)))
            return
        if scales is not None:
            k, v = quantize_fp8(k, scales[0]), quantize_fp8(v, scales[1])
        write_kv(k_pool, v_pool, slot_mapping, k, v)

    def _paged(self) -> torch.Tensor:
        return paged_view(self.storage, self.layout, self.num_pages)

    def read_pages(self, page_ids: list[int] | torch.Tensor) -> torch.Tensor:
        index = torch.as_tensor(page_ids, dtype=torch.long).to(self.device)
        paged = self._paged()
        return as_copyable(paged).index_select(2, index).view(paged.dtype)

    def write_pages(self, page_ids: list[int] | torch.Tensor, data: torch.Tensor) -> None:
        index = torch.as_tensor(page_ids, dtype=torch.long).to(self.device)
        paged = self._paged()
        expected = (*paged.shape[:2], index.numel(), *paged.shape[3:])
        if tuple(data.shape) != expected:
            raise ValueError(f"write_pages: data has shape {tuple(data.shape)}, this pool takes {expected}")
        if self.quantized and data.dtype != self.layout.kv_dtype:
            raise ValueError(
                f"write_pages: {data.dtype} pages into an FP8 pool need this pool's scales: use "
                "hearth.kv.convert.convert_pages"
            )
        as_copyable(paged).index_copy_(2, index, as_copyable(data.to(self.device, self.layout.kv_dtype)))

    def set_page_tags(self, page_ids: list[int], tags: list[int]) -> None:
        if page_ids:
            index = torch.tensor(page_ids, dtype=torch.long).to(self.device, non_blocking=True)
            values = torch.tensor(tags, dtype=torch.int64).to(self.device, non_blocking=True)
            self.page_tags.index_copy_(0, index, values)

    @staticmethod
    def num_pages_for_budget(layout: KVLayout, memory_bytes: int) -> int:
        return max(0, memory_bytes // layout.bytes_per_page)
