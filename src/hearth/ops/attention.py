"""Paged attention in plain torch: the reference implementation, and the CPU path.

Keys and values live in slot-addressed pools (`[num_slots, kv_heads, head_dim]`); a batch is decode
rows (one query token each, batched together) followed by prefill chunks (attended one by one,
since their lengths differ). The attention context carries the precomputed slot indices.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    query_start: int  # row of the chunk's first token in the flat batch
    query_len: int
    kv_slots: torch.Tensor  # long [context_len]: slots of every key the chunk attends to, in position order
    mask: torch.Tensor | None  # bool [query_len, context_len] (True = attend), None when plain causal


@dataclass
class AttentionContext:
    """One step's attention metadata, shared by every layer."""

    slot_mapping: torch.Tensor  # long [num_tokens]: where each new token's K/V is written
    num_decode_tokens: int = 0  # the first rows of the batch, one token per request
    decode_kv_slots: torch.Tensor | None = None  # long [num_decodes, max_context_len]
    decode_mask: torch.Tensor | None = None  # bool [num_decodes, 1, 1, max_context_len] (True = attend)
    prefills: list[PrefillChunk] = field(default_factory=list)


def write_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    k_pool.index_copy_(0, slot_mapping, k.to(k_pool.dtype))
    v_pool.index_copy_(0, slot_mapping, v.to(v_pool.dtype))


def paged_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, ctx: AttentionContext, scale: float
) -> torch.Tensor:
    """q `[num_tokens, heads, head_dim]` -> output `[num_tokens, heads, head_dim]`; K/V already written."""
    out = torch.empty_like(q)
    num_heads = q.shape[1]
    enable_gqa = num_heads != k_pool.shape[1]
    if ctx.num_decode_tokens:
        n = ctx.num_decode_tokens
        keys = k_pool[ctx.decode_kv_slots].to(q.dtype).transpose(1, 2)  # [n, kv_heads, ctx, dim]
        values = v_pool[ctx.decode_kv_slots].to(q.dtype).transpose(1, 2)
        query = q[:n].unsqueeze(2)  # [n, heads, 1, dim]
        attended = F.scaled_dot_product_attention(
            query, keys, values, attn_mask=ctx.decode_mask, scale=scale, enable_gqa=enable_gqa
        )
        out[:n] = attended.squeeze(2)
    for chunk in ctx.prefills:
        rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
        keys = k_pool[chunk.kv_slots].to(q.dtype).transpose(0, 1).unsqueeze(0)
        values = v_pool[chunk.kv_slots].to(q.dtype).transpose(0, 1).unsqueeze(0)
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
