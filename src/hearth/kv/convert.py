"""Converting KV pages between pool dtypes, for transfers between servers whose pools differ (precision per
role: a BF16 prefill pool hands pages to an FP8 decode pool). The receiver converts, with its own scales.

Pages are `KVPool.read_pages` tensors: `[num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]`
(index 0 of dim 1 is K, 1 is V), with the sender's scales `[num_layers, num_kv_heads]` when they are FP8.
"""

from __future__ import annotations

import torch

from hearth.kv.pool import KVPool
from hearth.ops.fp8 import FP8_MAX, is_fp8

Scales = tuple[torch.Tensor, torch.Tensor]  # (K, V), float32 [num_layers, num_kv_heads]


def _per_element(scales: Scales) -> torch.Tensor:
    """[num_layers, 2, 1, 1, num_kv_heads, 1]: broadcasts over pages' K/V values."""
    return torch.stack(scales, dim=1).float()[:, :, None, None, :, None]


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
    if is_fp8(pages.dtype) != (src_scales is not None):
        raise ValueError("convert_pages: src_scales are needed for FP8 pages and only for them")
    if is_fp8(dst_dtype) != (dst_scales is not None):
        raise ValueError("convert_pages: dst_scales are needed for an FP8 destination and only for it")
    if pages.dtype == dst_dtype and (
        src_scales is None
        or (torch.equal(src_scales[0], dst_scales[0]) and torch.equal(src_scales[1], dst_scales[1]))  # type: ignore[index]
    ):
        return pages
    values = pages.float()
    if src_scales is not None:
        values = values * _per_element(src_scales).to(values.device)
    if dst_scales is not None:
        values = (values / _per_element(dst_scales).to(values.device)).clamp_(-FP8_MAX, FP8_MAX)
    return values.to(dst_dtype)


def write_converted_pages(
    pool: KVPool, page_ids: list[int] | torch.Tensor, pages: torch.Tensor, src_scales: Scales | None = None
) -> None:
    """Write another pool's pages (its stored values and, if FP8, its scales) into `pool`, converting."""
    dst_scales: Scales | None = None
    if pool.quantized:
        if pool.k_scales is None or pool.v_scales is None:
            raise RuntimeError("the receiving FP8 pool has no scales yet")
        dst_scales = (pool.k_scales, pool.v_scales)
    pool.write_pages(page_ids, convert_pages(pages, pool.layout.kv_dtype, src_scales, dst_scales))


def pool_scales(pool: KVPool) -> Scales | None:
    """What a sender ships with its pages: its scales when it stores FP8, else None."""
    if not pool.quantized:
        return None
    assert pool.k_scales is not None and pool.v_scales is not None
    return pool.k_scales, pool.v_scales
