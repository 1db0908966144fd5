"""The one owner of a KV page's memory: where a page's bytes lie in the pool, how they are read out,
written in (converting dtype and FP8 scales), and what a page looks like outside the pool.

A page outside the pool (on the wire, in a tier) is page-major: `[num_layers, num_planes, page_size,
num_kv_heads, head_dim]` (`PageLayout.page_shape`), K then V for "mha" pools (2 planes), the latent alone
for "latent" (MLA) pools (1 plane). In the pool each (layer, plane) of a page is one contiguous run of
`page_size x heads x head_dim` values, so a page is `num_layers x num_planes` runs: readers and writers
copy run by run (a `copy_` per page: index_select + permute measured ~10x slower,
scripts/bench_kv_transfer.py), and a CPU pool's runs can go to `sendmsg`/`recvmsg_into` as they are.

A rank's pool is a shard of the model's KV: a TP rank holds some KV heads (`first_kv_head` of
`total_kv_heads`; MLA latents are whole on every rank), a PP stage some layers (`first_layer` of
`total_layers`). `PageLayout` says which, so pages moved between different parallel layouts can be
cut and re-assembled, and tiers file each rank's shard under its own name (`shard_key`).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import msgspec
import torch

from hearth.ops.fp8 import FP8_MAX, is_fp8

if TYPE_CHECKING:
    from hearth.kv.pool import KVLayout, KVPool

# (K, V) per (layer, KV head) scales of an FP8 pool, float32 `[num_layers, num_kv_heads]` (a latent pool's
# single plane reads the K scales): stored value x scale = real value. None for pools of real values.
Scales = tuple[torch.Tensor, torch.Tensor]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,  # with the sender's per (layer, KV head) scales
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def element_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class PageLayout(msgspec.Struct, frozen=True):
    """What one page of one rank's pool holds; both ends of a transfer compare it, tiers tag blobs with it.
    `dtype` is the pool's storage dtype (a transfer may convert it). The shard fields place this rank's
    layers and KV heads in the model's (0 / 0 / 0 = this pool is the whole model: one rank)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    kind: str
    dtype: str
    first_layer: int = 0
    total_layers: int = 0
    first_kv_head: int = 0
    total_kv_heads: int = 0

    @staticmethod
    def of(layout: KVLayout, first_layer: int = 0, total_layers: int = 0, first_kv_head: int = 0,
           total_kv_heads: int = 0) -> PageLayout:  # fmt: skip
        return PageLayout(
            num_layers=layout.num_layers,
            num_kv_heads=layout.num_kv_heads,
            head_dim=layout.head_dim,
            page_size=layout.page_size,
            kind=layout.kind,
            dtype=dtype_name(layout.kv_dtype),
            first_layer=first_layer,
            total_layers=total_layers or layout.num_layers,
            first_kv_head=first_kv_head,
            total_kv_heads=total_kv_heads or layout.num_kv_heads,
        )

    @property
    def num_planes(self) -> int:
        return 1 if self.kind == "latent" else 2

    @property
    def storage_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def model_kv_heads(self) -> int:
        return self.total_kv_heads or self.num_kv_heads

    @property
    def model_layers(self) -> int:
        return self.total_layers or self.num_layers

    @property
    def is_shard(self) -> bool:
        return self.num_kv_heads != self.model_kv_heads or self.num_layers != self.model_layers

    def page_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, self.num_planes, self.page_size, self.num_kv_heads, self.head_dim)

    def run_elements(self) -> int:
        """Values in one (layer, plane) run of a page."""
        return self.page_size * self.num_kv_heads * self.head_dim

    def page_bytes(self, dtype: torch.dtype | None = None) -> int:
        dtype = dtype if dtype is not None else self.storage_dtype
        return self.num_layers * self.num_planes * self.run_elements() * element_bytes(dtype)

    def describe(self) -> str:
        """The same words as `KVLayout.describe` (part of the prefix-key salt), plus the shard when one."""
        text = f"{self.kind}/{self.dtype}/p{self.page_size}/h{self.num_kv_heads}x{self.head_dim}/l{self.num_layers}"
        if self.is_shard:
            text += (
                f"/shard:l{self.first_layer}+{self.num_layers}of{self.model_layers}"
                f":h{self.first_kv_head}+{self.num_kv_heads}of{self.model_kv_heads}"
            )
        return text

    def mismatch(self, other: PageLayout) -> str | None:
        """Why pages of `other` cannot be written into pages of this layout, or None (only the dtype may differ)."""
        mine = (self.kind, self.num_layers, self.num_kv_heads, self.head_dim, self.page_size)
        theirs = (other.kind, other.num_layers, other.num_kv_heads, other.head_dim, other.page_size)
        if mine == theirs and (self.first_layer, self.first_kv_head) == (
            other.first_layer,
            other.first_kv_head,
        ):
            return None
        return (
            "KV layout mismatch between prefill and decode servers: "
            f"this side {self.describe()}, the peer {other.describe()} "
            "(kind, layers, KV heads, head dim and page size must match; only the dtype may differ)"
        )

    def shard_key(self, key: bytes) -> bytes:
        """The name a tier files this rank's shard of page `key` under (the key itself for a whole pool)."""
        if not self.is_shard:
            return key
        return hashlib.blake2b(key + self.describe().encode(), digest_size=len(key)).digest()


def _per_element(scales: Scales, num_planes: int, page_major: bool) -> torch.Tensor:
    """Scales broadcast over pages' values: `[1, layers, planes, 1, heads, 1]` page-major, else
    `[layers, planes, 1, 1, heads, 1]`."""
    both = torch.stack(scales[:num_planes], dim=1).float()  # [layers, planes, heads]
    if page_major:
        return both[None, :, :, None, :, None]
    return both[:, :, None, None, :, None]


def convert_values(
    pages: torch.Tensor,
    dst_dtype: torch.dtype,
    src_scales: Scales | None = None,
    dst_scales: Scales | None = None,
    page_major: bool = True,
) -> torch.Tensor:
    """`pages` (stored values of the sender's dtype) as stored values of a `dst_dtype` pool. FP8 sources are
    multiplied by `src_scales`, FP8 destinations divided by `dst_scales` and saturated. Same dtype and same
    scales (or none): returned as is, bit for bit. `page_major`: `[n, layers, planes, ...]`, else
    `[layers, planes, n, ...]` (`KVPool.read_pages`)."""
    if is_fp8(pages.dtype) != (src_scales is not None):
        raise ValueError("convert_pages: src_scales are needed for FP8 pages and only for them")
    if is_fp8(dst_dtype) != (dst_scales is not None):
        raise ValueError("convert_pages: dst_scales are needed for an FP8 destination and only for it")
    if pages.dtype == dst_dtype and (
        src_scales is None
        or (torch.equal(src_scales[0], dst_scales[0]) and torch.equal(src_scales[1], dst_scales[1]))  # type: ignore[index]
    ):
        return pages
    num_planes = pages.shape[2 if page_major else 1]
    values = pages.float()
    if src_scales is not None:
        values = values * _per_element(src_scales, num_planes, page_major).to(values.device)
    if dst_scales is not None:
        values = (values / _per_element(dst_scales, num_planes, page_major).to(values.device)).clamp_(
            -FP8_MAX, FP8_MAX
        )
    return values.to(dst_dtype)


def paged_view(storage: torch.Tensor, layout: KVLayout, num_pages: int) -> torch.Tensor:
    """A pool's storage as `[num_layers, num_planes, num_pages, page_size, heads, head_dim]` (a view)."""
    return storage.view(
        layout.num_layers,
        layout.num_planes,
        num_pages,
        layout.page_size,
        layout.num_kv_heads,
        layout.head_dim,
    )


def _copyable(t: torch.Tensor) -> torch.Tensor:
    """FP8 as its bytes: CPU `copy_` between float8 views of different strides is not supported everywhere."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t


class PageIO:
    """A pool's pages, read and written page-major (see the module docstring). One per pool; cheap."""

    def __init__(self, pool: KVPool, layout: PageLayout | None = None) -> None:
        self.pool = pool
        self.layout = layout if layout is not None else PageLayout.of(pool.layout)
        self._paged = paged_view(pool.storage, pool.layout, pool.num_pages)
        self._bytes: memoryview | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.pool.layout.kv_dtype

    @property
    def page_shape(self) -> tuple[int, int, int, int, int]:
        return self.layout.page_shape()

    @property
    def page_bytes(self) -> int:
        return self.layout.page_bytes()

    @property
    def scales(self) -> Scales | None:
        """What travels with this pool's pages: its FP8 scales, or None when it stores real values."""
        pool = self.pool
        if not pool.quantized:
            return None
        if pool.k_scales is None or pool.v_scales is None:
            raise RuntimeError("the FP8 KV pool has no scales yet")
        return pool.k_scales, pool.v_scales

    # ---- reading --------------------------------------------------------------------------------

    def read_into(self, page_ids: list[int], out: torch.Tensor) -> None:
        """Pages `page_ids` into `out` (`[len(page_ids), *page_shape]`, this pool's dtype, any device)."""
        paged = _copyable(self._paged)
        target = _copyable(out)
        for index, page_id in enumerate(page_ids):
            target[index].copy_(paged[:, :, page_id])

    def read(self, page_ids: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
        """A copy of the pages, page-major, on `device`: stays valid after the pool's pages are reused."""
        out = torch.empty((len(page_ids), *self.page_shape), dtype=self.dtype, device=device)
        self.read_into(page_ids, out)
        return out

    def page_runs(self, page_ids: list[int]) -> list[memoryview]:
        """The pool's bytes of `page_ids` as contiguous runs in page-major order (a page is `num_layers x
        num_planes` runs): what a sender hands `sendmsg` and a receiver `recvmsg_into`. CPU pools only."""
        if self.pool.storage.device.type != "cpu":
            raise ValueError("page runs are CPU memory")
        if self._bytes is None:
            self._bytes = memoryview(self.pool.storage.view(torch.uint8).numpy()).cast("B")
        whole = self._bytes
        run = self.layout.run_elements() * self.pool.storage.element_size()
        plane_stride = self.pool.num_pages * run
        planes = [plane * plane_stride for plane in range(self.layout.num_layers * self.layout.num_planes)]
        return [whole[base + pid * run : base + (pid + 1) * run] for pid in page_ids for base in planes]

    # ---- writing --------------------------------------------------------------------------------

    def writable_runs(self, page_ids: list[int], dtype: torch.dtype) -> list[memoryview] | None:
        """Where pages of `dtype` (no scales) can be received as they are, or None (they need converting)."""
        pool = self.pool
        if dtype != pool.layout.kv_dtype or pool.quantized or pool.storage.device.type != "cpu":
            return None
        return self.page_runs(page_ids)

    def write(self, page_ids: list[int], data: torch.Tensor, src_scales: Scales | None = None) -> None:
        """Pages `[len(page_ids), *page_shape]` (any float dtype, any device; FP8 with the writer's scales)
        into `page_ids`, converted to this pool's dtype and scales."""
        expected = (len(page_ids), *self.page_shape)
        if tuple(data.shape) != expected:
            raise ValueError(f"page write of shape {tuple(data.shape)}, this pool takes {expected}")
        pool = self.pool
        if pool.quantized or src_scales is not None:
            dst_scales = self.scales
            data = convert_values(data, pool.layout.kv_dtype, src_scales, dst_scales)
        paged = _copyable(self._paged)
        source = _copyable(data.to(pool.device, pool.layout.kv_dtype))
        for index, page_id in enumerate(page_ids):
            paged[:, :, page_id].copy_(source[index])
