"""Converting KV pages between pool dtypes, for transfers between servers whose pools differ (precision per
role: a BF16 prefill pool hands pages to an FP8 decode pool). The receiver converts, with its own scales.

Pages here are `KVPool.read_pages` tensors: `[num_layers, num_planes, num_pages, page_size, num_kv_heads,
head_dim]` (K then V, or the latent alone), with the sender's scales `[num_layers, num_kv_heads]` when they
are FP8. The arithmetic is `hearth.kv.page_io`'s (which moves page-major pages the same way).
"""

from __future__ import annotations

import torch

from hearth.kv.page_io import Scales, convert_values
from hearth.kv.pool import KVPool

__all__ = ["Scales", "convert_pages", "pool_scales", "write_converted_pages"]


def convert_pages(
    pages: torch.Tensor,
    dst_dtype: torch.dtype,
    src_scales: Scales | None = None,
    dst_scales: Scales | None = None,
) -> torch.Tensor:
    """`pages` (stored values, in the sender's dtype) as stored values of a `dst_dtype` pool.

    FP8 sources are multiplied by `src_scales`; FP8 destinations are divided by `dst_scales` and saturated.
    Same dtype and same scales (or none): returned as is, bit for bit.
    """
    return convert_values(pages, dst_dtype, src_scales, dst_scales, page_major=False)


def write_converted_pages(
    pool: KVPool, page_ids: list[int] | torch.Tensor, pages: torch.Tensor, src_scales: Scales | None = None
) -> None:
    """Write another pool's pages (its stored values and, if FP8, its scales) into `pool`, converting."""
    if pool.quantized and (pool.k_scales is None or pool.v_scales is None):
        raise RuntimeError("the receiving FP8 pool has no scales yet")
    ids = page_ids.tolist() if isinstance(page_ids, torch.Tensor) else list(page_ids)
    pool.io.write(ids, pages.permute(2, 0, 1, 3, 4, 5), src_scales)


def pool_scales(pool: KVPool) -> Scales | None:
    """What a sender ships with its pages: its scales when it stores FP8, else None."""
    return pool.io.scales
