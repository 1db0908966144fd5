"""Small fused kernels of the decoder layer: RMSNorm with the residual add, SiLU-and-mul, and the
rotate-half RoPE that writes keys and values straight into their KV pool slots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    sum_ptr,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_s,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    valid = offs < HIDDEN
    x = tl.load(x_ptr + row * stride_x + offs, mask=valid, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x = x + tl.load(residual_ptr + row * stride_r + offs, mask=valid, other=0.0).to(tl.float32)
        tl.store(sum_ptr + row * stride_s + offs, x.to(sum_ptr.dtype.element_ty), mask=valid)
    variance = tl.sum(x * x, 0) / HIDDEN
    # Rounded to the output dtype before the weight, like the reference implementations.
    normed = (x * tl.rsqrt(variance + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (weight * normed).to(out_ptr.dtype.element_ty), mask=valid)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual) * weight, x + residual) for `x` `[tokens, hidden]`; the sum is `x` without residual."""
    num_tokens, hidden = x.shape
    out = torch.empty_like(x)
    summed = torch.empty_like(x) if residual is not None else x
    if num_tokens:
        _rms_norm_kernel[(num_tokens,)](
            x,
            residual if residual is not None else x,
            weight,
            out,
            summed,
            eps,
            x.stride(0),
            (residual if residual is not None else x).stride(0),
            out.stride(0),
            summed.stride(0),
            HIDDEN=hidden,
            BLOCK=triton.next_power_of_2(hidden),
            HAS_RESIDUAL=residual is not None,
        )
    return out, summed


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, SIZE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < SIZE
    gate = tl.load(x_ptr + row * stride_x + offs, mask=valid, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + SIZE + offs, mask=valid, other=0.0)
    activated = (gate * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty).to(tl.float32)  # rounded like F.silu
    tl.store(
        out_ptr + row * stride_o + offs,
        (activated * up.to(tl.float32)).to(out_ptr.dtype.element_ty),
        mask=valid,
    )


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for `x` = [gate | up] `[tokens, 2 * size]`."""
    num_tokens, double = x.shape
    size = double // 2
    out = torch.empty(num_tokens, size, dtype=x.dtype, device=x.device)
    if num_tokens:
        block = min(1024, triton.next_power_of_2(size))
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(size, block))](
            x, out, x.stride(0), out.stride(0), SIZE=size, BLOCK=block
        )
    return out


@triton.jit
def _rotary_write_kv_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_pool_ptr,
    v_pool_ptr,
    slot_ptr,
    stride_qkv,
    stride_cos,
    stride_sin,
    stride_q_tok,
    stride_q_head,
    stride_kv_slot,
    stride_kv_head,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF_PADDED: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)  # 0..heads-1: a query head; then the KV heads
    half: tl.constexpr = HEAD_DIM // 2
    offs = tl.arange(0, HALF_PADDED)
    valid = offs < half
    cos = tl.load(cos_ptr + token * stride_cos + offs, mask=valid, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_sin + offs, mask=valid, other=0.0).to(tl.float32)
    base = qkv_ptr + token * stride_qkv + head * HEAD_DIM
    x1 = tl.load(base + offs, mask=valid, other=0.0).to(tl.float32)
    x2 = tl.load(base + half + offs, mask=valid, other=0.0).to(tl.float32)
    rotated1 = x1 * cos - x2 * sin
    rotated2 = x2 * cos + x1 * sin
    if head < NUM_HEADS:
        dest = q_out_ptr + token * stride_q_tok + head * stride_q_head
        tl.store(dest + offs, rotated1.to(q_out_ptr.dtype.element_ty), mask=valid)
        tl.store(dest + half + offs, rotated2.to(q_out_ptr.dtype.element_ty), mask=valid)
    else:
        kv_head = head - NUM_HEADS
        slot = tl.load(slot_ptr + token)
        k_dest = k_pool_ptr + slot * stride_kv_slot + kv_head * stride_kv_head
        tl.store(k_dest + offs, rotated1.to(k_pool_ptr.dtype.element_ty), mask=valid)
        tl.store(k_dest + half + offs, rotated2.to(k_pool_ptr.dtype.element_ty), mask=valid)
        v_src = qkv_ptr + token * stride_qkv + (NUM_HEADS + NUM_KV_HEADS + kv_head) * HEAD_DIM
        v_dest = v_pool_ptr + slot * stride_kv_slot + kv_head * stride_kv_head
        v1 = tl.load(v_src + offs, mask=valid, other=0.0)
        v2 = tl.load(v_src + half + offs, mask=valid, other=0.0)
        tl.store(v_dest + offs, v1.to(v_pool_ptr.dtype.element_ty), mask=valid)
        tl.store(v_dest + half + offs, v2.to(v_pool_ptr.dtype.element_ty), mask=valid)


def rotary_write_kv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Rotated queries `[tokens, heads, head_dim]` from the fused projection `qkv`; rotated keys and the
    values go to `k_pool`/`v_pool` `[slots, kv_heads, head_dim]` at `slot_mapping`. Same contract as the
    CPU kernel (`hearth.ops.cpu_kernels.rotary_write_kv_kernel`)."""
    num_tokens = qkv.shape[0]
    num_kv_heads, head_dim = k_pool.shape[1], k_pool.shape[2]
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if num_tokens:
        _rotary_write_kv_kernel[(num_tokens, num_heads + num_kv_heads)](
            qkv,
            cos,
            sin,
            q,
            k_pool,
            v_pool,
            slot_mapping,
            qkv.stride(0),
            cos.stride(0),
            sin.stride(0),
            q.stride(0),
            q.stride(1),
            k_pool.stride(0),
            k_pool.stride(1),
            NUM_HEADS=num_heads,
            NUM_KV_HEADS=num_kv_heads,
            HEAD_DIM=head_dim,
            HALF_PADDED=triton.next_power_of_2(head_dim // 2),
        )
    return q
