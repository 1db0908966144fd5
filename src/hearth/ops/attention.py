"""Paged attention in plain torch: the reference implementation, and the CPU path.

Keys and values live in slot-addressed pools (`[num_slots, kv_heads, head_dim]`, slot = page *
page_size + offset); a batch is decode rows (one query token each, batched together) followed by
prefill chunks (attended one by one, since their lengths differ). Keys are gathered a whole page at
a time (`index_select` of page-sized rows), several times faster on CPU than a gather per slot.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from hearth.ops.cpu_kernels import paged_decode_attention_kernel


@dataclass
class PrefillChunk:
    query_start: int  # row of the chunk's first token in the flat batch
    query_len: int
    page_ids: torch.Tensor  # long [num_pages]: the pages holding the chunk's context, in position order
    context_len: int
    mask: torch.Tensor | None  # bool [query_len, context_len] (True = attend), None when plain causal


@dataclass
class AttentionContext:
    """One step's attention metadata, shared by every layer."""

    slot_mapping: torch.Tensor  # long [num_tokens]: where each new token's K/V is written
    page_size: int
    num_decode_tokens: int = 0  # the first rows of the batch, one token per request
    decode_page_table: torch.Tensor | None = None  # long [num_decodes, max_pages] (padding: any valid page)
    decode_context_lens: torch.Tensor | None = None  # long [num_decodes]
    decode_first_positions: torch.Tensor | None = (
        None  # long [num_decodes]: first key attended (sliding window)
    )
    prefills: list[PrefillChunk] = field(default_factory=list)


def write_kv(
    k_pool: torch.Tensor, v_pool: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    k_pool.index_copy_(0, slot_mapping, k.to(k_pool.dtype))
    v_pool.index_copy_(0, slot_mapping, v.to(v_pool.dtype))


def gather_pages(pool: torch.Tensor, page_ids: torch.Tensor, page_size: int) -> torch.Tensor:
    """`[*page_ids.shape[:-1], num_pages * page_size, kv_heads, head_dim]` from a slot-addressed pool."""
    num_slots, kv_heads, head_dim = pool.shape
    rows = pool.view(num_slots // page_size, page_size * kv_heads * head_dim).index_select(
        0, page_ids.flatten()
    )
    return rows.view(*page_ids.shape[:-1], page_ids.shape[-1] * page_size, kv_heads, head_dim)


def _decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    ctx: AttentionContext,
    scale: float,
    page_size: int,
) -> torch.Tensor:
    """One query token per row. The compiled CPU kernel reads pages in place; torch gathers them first."""
    if q.dtype == torch.float32 and k_pool.dtype == torch.float32 and q.device.type == "cpu":
        kernel = paged_decode_attention_kernel()
        if kernel is not None:
            return kernel(
                q.contiguous(),
                k_pool,
                v_pool,
                ctx.decode_page_table,
                ctx.decode_context_lens,
                ctx.decode_first_positions,
                page_size,
                scale,
            )
    # Key positions [first, context_len) of each row are attended; the rest is padding or out of the window.
    positions = torch.arange(ctx.decode_page_table.shape[1] * page_size)
    mask = (positions[None, :] < ctx.decode_context_lens[:, None]) & (
        positions[None, :] >= ctx.decode_first_positions[:, None]
    )
    keys = gather_pages(k_pool, ctx.decode_page_table, page_size).to(q.dtype).transpose(1, 2)
    values = gather_pages(v_pool, ctx.decode_page_table, page_size).to(q.dtype).transpose(1, 2)
    attended = F.scaled_dot_product_attention(
        q.unsqueeze(2),
        keys,
        values,
        attn_mask=mask[:, None, None, :],
        scale=scale,
        enable_gqa=q.shape[1] != k_pool.shape[1],
    )
    return attended.squeeze(2)


def paged_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    ctx: AttentionContext,
    scale: float,
    page_size: int,
) -> torch.Tensor:
    """q `[num_tokens, heads, head_dim]` -> output `[num_tokens, heads, head_dim]`; K/V already written."""
    out = torch.empty_like(q)
    num_heads = q.shape[1]
    enable_gqa = num_heads != k_pool.shape[1]
    if ctx.num_decode_tokens:
        n = ctx.num_decode_tokens
        out[:n] = _decode_attention(q[:n], k_pool, v_pool, ctx, scale, page_size)
    for chunk in ctx.prefills:
        rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
        keys = gather_pages(k_pool, chunk.page_ids, page_size)[: chunk.context_len].to(q.dtype)
        values = gather_pages(v_pool, chunk.page_ids, page_size)[: chunk.context_len].to(q.dtype)
        keys = keys.transpose(0, 1).unsqueeze(0)
        values = values.transpose(0, 1).unsqueeze(0)
        query = q[rows].transpose(0, 1).unsqueeze(0)
        attended = F.scaled_dot_product_attention(
            query,
            keys,
            values,
            attn_mask=chunk.mask,
            is_causal=chunk.mask is None,
            scale=scale,
            enable_gqa=enable_gqa,
        )
        out[rows] = attended.squeeze(0).transpose(0, 1)
    return out
