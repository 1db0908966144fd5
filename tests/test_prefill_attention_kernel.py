"""The compiled prefill-attention kernel (flash-style tiles over a prompt chunk's pages) against attention computed
in float64 from the same pages: float32 and bf16 queries over float32, bf16 and FP8 pools; chunks with a cached
prefix, a sliding window, GQA and MQA, head dims from 16 to MLA's 576, pages handed out out of order, slots outside
the context holding NaN (never read); and through the CPU backend, against the torch path it replaces."""

from __future__ import annotations

import pytest
import torch

from hearth.ops import cpu_kernels
from hearth.ops.fp8 import FP8_DTYPE

pytestmark = pytest.mark.skipif(
    cpu_kernels.paged_decode_attention_kernel(wait=True) is None,
    reason="no C++ toolchain for torch extensions",
)


def _kernel_or_skip(dtype: torch.dtype):
    kernel = cpu_kernels.prefill_attention_kernel(dtype)
    if kernel is None:
        pytest.skip(f"this CPU build has no tile math for {dtype} queries (the torch path serves them)")
    return kernel


def _pools(context_len: int, kv_heads: int, dim: int, page_size: int, dtype: torch.dtype, seed: int):
    """Pools whose slots outside the context are NaN, the context's pages in a shuffled order."""
    gen = torch.Generator().manual_seed(seed)
    num_pages = -(-context_len // page_size)
    total_pages = num_pages + 3
    k = torch.full((total_pages * page_size, kv_heads, dim), float("nan"))
    v = torch.full_like(k, float("nan"))
    pages = torch.randperm(total_pages, generator=gen)[:num_pages]
    slots = (pages[:, None] * page_size + torch.arange(page_size)[None, :]).flatten()[:context_len]
    k[slots] = torch.randn(context_len, kv_heads, dim, generator=gen)
    v[slots] = torch.randn(context_len, kv_heads, dim, generator=gen)
    return k.to(dtype), v.to(dtype), pages, slots


def _reference(q, keys, values, context_len: int, window: int, scale: float) -> torch.Tensor:
    """float64 attention of the chunk's queries (the last `len(q)` positions) over keys/values [context, kv, dim]."""
    queries, heads, _ = q.shape
    group = heads // keys.shape[1]
    start = context_len - queries
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(queries):
        pos = start + i
        first = max(0, pos - window + 1) if window else 0
        for head in range(heads):
            k = keys[first : pos + 1, head // group].double()
            v = values[first : pos + 1, head // group].double()
            out[i, head] = torch.softmax(k @ q[i, head].double() * scale, dim=0) @ v
    return out


CASES = [
    # (queries, context, heads, kv heads, head dim, window, page size)
    (200, 200, 9, 3, 64, 0, 16),  # a whole prompt, GQA as SmolLM2
    (37, 141, 4, 2, 128, 0, 16),  # a chunk after a cached prefix, rows not a multiple of the tiles
    (5, 70, 2, 1, 16, 0, 4),  # a short chunk, MQA, the smallest head dim
    (130, 300, 8, 8, 48, 50, 16),  # a sliding window that bites, MHA, a head dim the tiles cut 32 + 16
    (96, 96, 2, 2, 80, 17, 8),  # a window smaller than a key block
    (40, 40, 4, 1, 576, 0, 16),  # MLA's absorbed form: one latent KV head 576 wide
]


@pytest.mark.parametrize("queries,context_len,heads,kv_heads,dim,window,page_size", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_attention_matches_float64(
    queries, context_len, heads, kv_heads, dim, window, page_size, dtype
):
    kernel = _kernel_or_skip(dtype)
    k, v, pages, slots = _pools(context_len, kv_heads, dim, page_size, dtype, seed=queries + dim)
    q = torch.randn(queries, heads, dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    scale = dim**-0.5
    out = kernel(q, k, v, None, None, pages, context_len, page_size, window, scale)
    assert out.dtype == dtype and out.shape == q.shape
    expected = _reference(q.float(), k[slots].float(), v[slots].float(), context_len, window, scale)
    assert not torch.isnan(out).any()
    # float32 accumulates in float32 throughout; bf16 rounds P (as SDPA's bf16 kernel) and the output to bf16.
    tolerance = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_attention_over_fp8_pools_dequantizes_by_head_scale(dtype):
    kernel = _kernel_or_skip(dtype)
    context_len, queries, heads, kv_heads, dim, page_size = 150, 60, 6, 3, 64, 16
    k32, v32, pages, slots = _pools(context_len, kv_heads, dim, page_size, torch.float32, seed=7)
    k_scale = torch.tensor([0.02, 0.05, 0.01])
    v_scale = torch.tensor([0.03, 0.01, 0.04])
    k8 = (k32 / k_scale[None, :, None]).nan_to_num(0.0).clamp(-448, 448).to(FP8_DTYPE)
    v8 = (v32 / v_scale[None, :, None]).nan_to_num(0.0).clamp(-448, 448).to(FP8_DTYPE)
    q = torch.randn(queries, heads, dim, generator=torch.Generator().manual_seed(3)).to(dtype)
    out = kernel(q, k8, v8, k_scale, v_scale, pages, context_len, page_size, 0, dim**-0.5)
    keys = k8[slots].float() * k_scale[None, :, None]
    values = v8[slots].float() * v_scale[None, :, None]
    expected = _reference(q.float(), keys, values, context_len, 0, dim**-0.5)
    tolerance = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)


def test_prefill_attention_refuses_what_it_cannot_read():
    kernel = _kernel_or_skip(torch.float32)
    k, v, pages, _ = _pools(64, 2, 64, 16, torch.float32, seed=0)
    q = torch.randn(8, 4, 64)
    with pytest.raises(RuntimeError, match="page ids covering the context"):
        kernel(q, k, v, None, None, pages[:2], 64, 16, 0, 0.125)
    with pytest.raises(RuntimeError, match="page id outside the pool"):
        kernel(q, k, v, None, None, pages + 100, 64, 16, 0, 0.125)
    with pytest.raises(RuntimeError, match="FP8 pools need"):
        kernel(q, k.to(FP8_DTYPE), v.to(FP8_DTYPE), None, None, pages, 64, 16, 0, 0.125)
    with pytest.raises(RuntimeError, match="queries <= context_len"):
        kernel(torch.randn(70, 4, 64), k, v, None, None, pages, 64, 16, 0, 0.125)


def test_bf16_rotary_kv_write_and_silu_mul_are_the_torch_paths_bit_for_bit():
    from hearth.model.rotary import apply_rotary

    rotary, silu_mul = cpu_kernels.rotary_write_kv_bf16_kernel(), cpu_kernels.silu_and_mul_bf16_kernel()
    assert rotary is not None and silu_mul is not None
    gen = torch.Generator().manual_seed(0)
    tokens, heads, kv_heads, dim = 150, 6, 2, 64
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen) * 3).to(torch.bfloat16)
    angles = torch.randn(tokens, dim // 2, generator=gen) * 5
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    k_pool = torch.zeros(200, kv_heads, dim, dtype=torch.bfloat16)
    v_pool = torch.zeros_like(k_pool)
    slots = torch.randperm(200, generator=gen)[:tokens]
    q = rotary(qkv, cos, sin, heads, k_pool, v_pool, slots)
    q_ref, k_ref, v_ref = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    assert torch.equal(q, apply_rotary(q_ref.view(tokens, heads, dim), cos, sin))
    assert torch.equal(k_pool[slots], apply_rotary(k_ref.view(tokens, kv_heads, dim), cos, sin))
    assert torch.equal(v_pool[slots], v_ref.view(tokens, kv_heads, dim))
    gate_up = (torch.randn(70, 2 * 200, generator=gen) * 4).to(torch.bfloat16)  # 200: a vector tail of 8
    gate, up = gate_up.split(200, dim=-1)
    assert torch.equal(silu_mul(gate_up), torch.nn.functional.silu(gate) * up)
