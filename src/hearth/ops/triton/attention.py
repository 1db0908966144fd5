"""Paged attention in Triton, over the KV pool in place (no gathered copy of a row's context).

`paged_attention` serves every row shape (prefill chunks, decode rows, rows with drafts): one program
per (row, query head, block of query tokens) walks the row's context in blocks of keys, reading each
key's slot through the page table, with an online softmax in float32. `paged_decode` is the decode
path for long contexts: split-K, one program per (row, KV head, split) attends all the query heads
that share the KV head (GQA), then a second kernel merges the splits.

Both take optional per-KV-head dequantization scales (`k_scale`, `v_scale`, float32 `[kv_heads]`) for
an FP8 pool: keys and values are multiplied by them after the load.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _load_kv_block(
    k_ptr,
    v_ptr,
    row_pages_ptr,
    offs_n,
    n_valid,
    offs_d,
    d_valid,
    kv_head,
    stride_kv_slot,
    stride_kv_head,
    PAGE_SIZE: tl.constexpr,
):
    """Keys and values (float32) of context positions `offs_n` of one row, read through its page list."""
    page = tl.load(row_pages_ptr + offs_n // PAGE_SIZE, mask=n_valid, other=0)
    slot = page * PAGE_SIZE + offs_n % PAGE_SIZE
    kv_offsets = slot[:, None] * stride_kv_slot + kv_head * stride_kv_head + offs_d[None, :]
    kv_mask = n_valid[:, None] & d_valid[None, :]
    k = tl.load(k_ptr + kv_offsets, mask=kv_mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + kv_offsets, mask=kv_mask, other=0.0).to(tl.float32)
    return k, v


@triton.jit
def _online_softmax_update(qk, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    """Fold one block of scores `qk` (-inf where not attended) and its values into the running
    max `m_i`, normalizer `l_i` and unnormalized output `acc`."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing attended yet
    p = tl.exp(qk - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    page_table_ptr,
    query_start_ptr,
    seq_lens_ptr,
    k_scale_ptr,
    v_scale_ptr,
    scale,
    sliding_window,
    stride_q_tok,
    stride_q_head,
    stride_kv_slot,
    stride_kv_head,
    stride_o_tok,
    stride_o_head,
    stride_pt_row,
    NUM_QUERIES_PER_KV: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_SCALES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    block_m = tl.program_id(2)
    query_start = tl.load(query_start_ptr + row)
    query_len = tl.load(query_start_ptr + row + 1) - query_start
    if block_m * BLOCK_M >= query_len:
        return
    context_len = tl.load(seq_lens_ptr + row)
    kv_head = head // NUM_QUERIES_PER_KV

    offs_m = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    m_valid = offs_m < query_len
    d_valid = offs_d < HEAD_DIM
    query_pos = context_len - query_len + offs_m  # absolute position of each query token
    q = tl.load(
        q_ptr + (query_start + offs_m)[:, None] * stride_q_tok + head * stride_q_head + offs_d[None, :],
        mask=m_valid[:, None] & d_valid[None, :],
        other=0.0,
    ).to(tl.float32)
    if HAS_SCALES:
        k_scale = tl.load(k_scale_ptr + kv_head)
        v_scale = tl.load(v_scale_ptr + kv_head)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], tl.float32)
    last_pos = tl.minimum(context_len - query_len + (block_m + 1) * BLOCK_M, context_len)  # exclusive
    window_start = tl.maximum(context_len - query_len + block_m * BLOCK_M - sliding_window + 1, 0)
    first_pos = tl.where(sliding_window > 0, window_start, 0)
    start = (first_pos // BLOCK_N) * BLOCK_N
    for key_start in range(start, last_pos, BLOCK_N):
        offs_n = key_start + tl.arange(0, BLOCK_N)
        n_valid = offs_n < last_pos
        k, v = _load_kv_block(
            k_ptr, v_ptr, page_table_ptr + row * stride_pt_row, offs_n, n_valid, offs_d, d_valid, kv_head,
            stride_kv_slot, stride_kv_head, PAGE_SIZE,
        )  # fmt: skip
        if HAS_SCALES:
            k = k * k_scale
            v = v * v_scale
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        attend = (offs_n[None, :] <= query_pos[:, None]) & n_valid[None, :] & m_valid[:, None]
        in_window = (offs_n[None, :] > query_pos[:, None] - sliding_window) | (sliding_window <= 0)
        attend = attend & in_window
        qk = tl.where(attend, qk, float("-inf"))
        m_i, l_i, acc = _online_softmax_update(qk, v, m_i, l_i, acc, DOT_PRECISION)
    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + (query_start + offs_m)[:, None] * stride_o_tok + head * stride_o_head + offs_d[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=m_valid[:, None] & d_valid[None, :],
    )


def _dot_precision(q: torch.Tensor) -> str:
    """float32 models get IEEE float32 dots: Triton's default for float32 operands is TF32 on the tensor
    cores (~1e-3 relative error), which flips greedy tokens against a float32 reference."""
    return "ieee" if q.dtype == torch.float32 else "tf32"


def _pow2(n: int, minimum: int = 16) -> int:
    return max(minimum, triton.next_power_of_2(n))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    page_size: int,
    sliding_window: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of `q` `[tokens, heads, head_dim]` over each row's paged context.

    `k_cache`/`v_cache` `[slots, kv_heads, head_dim]` (slot = page * page_size + offset); row r's queries
    are tokens `query_start_loc[r] .. query_start_loc[r+1]`, the last ones of a context of
    `seq_lens[r]` tokens held in pages `page_table[r]`.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    num_rows = seq_lens.shape[0]
    out = torch.empty_like(q) if out is None else out
    if num_tokens == 0 or num_rows == 0:
        return out
    block_m = 16 if max_query_len <= 16 else 32
    grid = (num_rows, num_heads, triton.cdiv(max_query_len, block_m))
    has_scales = k_scale is not None
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        page_table,
        query_start_loc,
        seq_lens,
        k_scale if has_scales else seq_lens,
        v_scale if has_scales else seq_lens,
        scale,
        sliding_window or 0,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        out.stride(0),
        out.stride(1),
        page_table.stride(0),
        NUM_QUERIES_PER_KV=num_heads // num_kv_heads,
        PAGE_SIZE=page_size,
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=_pow2(head_dim),
        BLOCK_M=block_m,
        BLOCK_N=32,
        HAS_SCALES=has_scales,
        DOT_PRECISION=_dot_precision(q),
    )
    return out


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    part_out_ptr,
    part_lse_ptr,
    page_table_ptr,
    seq_lens_ptr,
    k_scale_ptr,
    v_scale_ptr,
    scale,
    sliding_window,
    keys_per_split,
    num_splits,
    stride_q_tok,
    stride_q_head,
    stride_kv_slot,
    stride_kv_head,
    stride_pt_row,
    stride_po_row,
    stride_po_head,
    stride_po_split,
    stride_pl_row,
    stride_pl_head,
    NUM_QUERIES_PER_KV: tl.constexpr,
    GROUP_PADDED: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_SCALES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(seq_lens_ptr + row)
    first_pos = tl.where(sliding_window > 0, tl.maximum(context_len - sliding_window, 0), 0)
    # keys_per_split 0: each row cuts its own context (CUDA graphs: no host-side length baked into the launch)
    row_split = (tl.cdiv(tl.cdiv(context_len - first_pos, num_splits), BLOCK_N) * BLOCK_N).to(tl.int32)
    split_keys = tl.where(keys_per_split > 0, keys_per_split, row_split)
    split_start = first_pos + split * split_keys
    split_end = tl.minimum(split_start + split_keys, context_len)

    offs_g = tl.arange(0, GROUP_PADDED)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    g_valid = offs_g < NUM_QUERIES_PER_KV
    d_valid = offs_d < HEAD_DIM
    heads = kv_head * NUM_QUERIES_PER_KV + offs_g
    q = tl.load(
        q_ptr + row * stride_q_tok + heads[:, None] * stride_q_head + offs_d[None, :],
        mask=g_valid[:, None] & d_valid[None, :],
        other=0.0,
    ).to(tl.float32)
    if HAS_SCALES:
        k_scale = tl.load(k_scale_ptr + kv_head)
        v_scale = tl.load(v_scale_ptr + kv_head)
    m_i = tl.full([GROUP_PADDED], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PADDED], tl.float32)
    acc = tl.zeros([GROUP_PADDED, HEAD_DIM_PADDED], tl.float32)
    for key_start in range(split_start, split_end, BLOCK_N):
        offs_n = key_start + tl.arange(0, BLOCK_N)
        n_valid = offs_n < split_end
        k, v = _load_kv_block(
            k_ptr, v_ptr, page_table_ptr + row * stride_pt_row, offs_n, n_valid, offs_d, d_valid, kv_head,
            stride_kv_slot, stride_kv_head, PAGE_SIZE,
        )  # fmt: skip
        if HAS_SCALES:
            k = k * k_scale
            v = v * v_scale
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        qk = tl.where(n_valid[None, :], qk, float("-inf"))
        m_i, l_i, acc = _online_softmax_update(qk, v, m_i, l_i, acc, DOT_PRECISION)
    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    lse = tl.where(
        l_i == 0.0, float("-inf"), m_i + tl.log(tl.where(l_i == 0.0, 1.0, l_i))
    )  # an empty split weighs nothing
    tl.store(
        part_out_ptr
        + row * stride_po_row
        + heads[:, None] * stride_po_head
        + split * stride_po_split
        + offs_d[None, :],
        acc,
        mask=g_valid[:, None] & d_valid[None, :],
    )
    tl.store(part_lse_ptr + row * stride_pl_row + heads * stride_pl_head + split, lse, mask=g_valid)


@triton.jit
def _decode_merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_po_row,
    stride_po_head,
    stride_po_split,
    stride_pl_row,
    stride_pl_head,
    stride_o_tok,
    stride_o_head,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PADDED: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PADDED)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    s_valid = offs_s < NUM_SPLITS
    lse = tl.load(
        part_lse_ptr + row * stride_pl_row + head * stride_pl_head + offs_s, mask=s_valid, other=float("-inf")
    )
    lse_max = tl.max(lse, 0)
    weights = tl.exp(lse - lse_max)
    weights = weights / tl.sum(weights, 0)
    parts = tl.load(
        part_out_ptr
        + row * stride_po_row
        + head * stride_po_head
        + offs_s[:, None] * stride_po_split
        + offs_d[None, :],
        mask=s_valid[:, None] & (offs_d[None, :] < HEAD_DIM),
        other=0.0,
    )
    merged = tl.sum(parts * weights[:, None], 0)
    tl.store(
        out_ptr + row * stride_o_tok + head * stride_o_head + offs_d,
        merged.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
    page_size: int,
    sliding_window: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    per_row_splits: bool = False,
) -> torch.Tensor:
    """Decode attention (one query token per row, `q` `[rows, heads, head_dim]`), split-K over the context.

    `num_splits` defaults to enough splits of >= 256 keys to cover `max_seq_len` (at most 16), so a
    batch of one long row still spreads over many programs. `per_row_splits`: each row cuts its own
    context into `num_splits` parts on the device and `max_seq_len` is ignored, so the launch depends
    on no step's lengths (what a captured CUDA graph needs).
    """
    num_rows, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    out = torch.empty_like(q) if out is None else out
    if num_rows == 0:
        return out
    block_n = 32
    if per_row_splits:
        if num_splits is None:
            raise ValueError("per_row_splits needs num_splits")
        keys_per_split = 0
    else:
        attended = min(max_seq_len, sliding_window) if sliding_window else max_seq_len
        if num_splits is None:
            num_splits = max(1, min(16, triton.cdiv(attended, 256)))
        keys_per_split = triton.cdiv(triton.cdiv(attended, num_splits), block_n) * block_n
    part_out = torch.empty(num_rows, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(num_rows, num_heads, num_splits, dtype=torch.float32, device=q.device)
    group = num_heads // num_kv_heads
    has_scales = k_scale is not None
    _decode_split_kernel[(num_rows, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        part_out,
        part_lse,
        page_table,
        seq_lens,
        k_scale if has_scales else seq_lens,
        v_scale if has_scales else seq_lens,
        scale,
        sliding_window or 0,
        keys_per_split,
        num_splits,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        page_table.stride(0),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        NUM_QUERIES_PER_KV=group,
        GROUP_PADDED=_pow2(group),
        PAGE_SIZE=page_size,
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=_pow2(head_dim),
        BLOCK_N=block_n,
        HAS_SCALES=has_scales,
        DOT_PRECISION=_dot_precision(q),
    )
    _decode_merge_kernel[(num_rows, num_heads)](
        part_out,
        part_lse,
        out,
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        out.stride(0),
        out.stride(1),
        NUM_SPLITS=num_splits,
        SPLITS_PADDED=triton.next_power_of_2(num_splits),
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=_pow2(head_dim),
    )
    return out
