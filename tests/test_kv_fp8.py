"""FP8 e4m3 KV cache: quantize on write, dequantize on read, in every backend and in the fused rotary write,
against attention over fake-quantized keys and values in float64; scales from the checkpoint or calibration."""

from __future__ import annotations

import pytest
import torch
from test_attention_backends import (
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    MIXED_PAGES,
    MIXED_ROWS,
    PAGE_SIZE,
    make_step,
)

from hearth.engine.fp8_kv_scales import scales_from_checkpoint
from hearth.kv.pool import KVLayout, KVPool, resolve_kv_dtype
from hearth.model.kv_scale_names import kv_scale_target
from hearth.ops import cpu_kernels
from hearth.ops.attention.cpu import CpuBackend
from hearth.ops.attention.torch_ref import TorchRefBackend
from hearth.ops.fp8 import FP8_DTYPE, FP8_MAX, fake_quantize_fp8, quantize_fp8, scales_from_amax

# Heads of very different sizes: one scale for all (or 1.0) would flush one head or saturate the other.
HEAD_MAGNITUDES = torch.tensor([3000.0, 0.01])


def fp8_pool(num_pages: int = 16) -> KVPool:
    layout = KVLayout(1, KV_HEADS, HEAD_DIM, PAGE_SIZE, resolve_kv_dtype("fp8_e4m3", torch.float32))
    return KVPool(layout, num_pages)


def scaled_randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape) * HEAD_MAGNITUDES.view(-1, 1)


def reference_attention_dequantized(q, keys, values, step, scale, window):
    """Per query token, softmax over its row's (already dequantized, float64) keys slot by slot."""
    width = step.page_table_width
    out = torch.empty(q.shape, dtype=torch.float64)
    for row in range(len(step.seq_lens)):
        pages = step.page_table[row * width : (row + 1) * width]
        for t in range(step.query_start_loc[row], step.query_start_loc[row + 1]):
            p = step.positions[t]
            first = 0 if window is None else max(0, p - window + 1)
            slots = [pages[k // PAGE_SIZE] * PAGE_SIZE + k % PAGE_SIZE for k in range(first, p + 1)]
            for head in range(HEADS):
                kv_head = head // (HEADS // KV_HEADS)
                k, v = keys[slots, kv_head], values[slots, kv_head]
                weights = torch.softmax(k @ q[t, head].double() * scale, dim=0)
                out[t, head] = weights @ v
    return out


def test_fp8_dtype_is_one_byte_so_the_same_memory_holds_twice_the_tokens_of_bf16():
    bf16 = KVLayout(4, 2, 64, 16, torch.bfloat16)
    fp8 = KVLayout(4, 2, 64, 16, resolve_kv_dtype("fp8_e4m3", torch.float32))
    budget = 1 << 24
    assert KVPool.num_pages_for_budget(fp8, budget) == 2 * KVPool.num_pages_for_budget(bf16, budget)
    assert fp8.describe() != bf16.describe()  # prefix keys never match across dtypes


def test_quantize_saturates_instead_of_making_nan_and_rounds_to_nearest():
    scale = torch.tensor([2.0])
    x = torch.tensor([[[1e6, -1e6, 3.0, 0.0]]])
    q = quantize_fp8(x, scale).float() * 2.0
    assert torch.isfinite(q).all()
    assert q[0, 0].tolist() == [2 * FP8_MAX, -2 * FP8_MAX, 3.0, 0.0]


def test_pool_refuses_to_store_without_scales_rather_than_use_one():
    pool = fp8_pool()
    with pytest.raises(RuntimeError, match="no scales"):
        pool.store(0, torch.tensor([0]), torch.ones(1, KV_HEADS, HEAD_DIM), torch.ones(1, KV_HEADS, HEAD_DIM))
    with pytest.raises(ValueError, match="finite and > 0"):
        pool.set_scales(torch.zeros(1, KV_HEADS), torch.ones(1, KV_HEADS))


@pytest.mark.parametrize("backend_cls", [TorchRefBackend, CpuBackend])
@pytest.mark.parametrize("window", [None, 5])
def test_fp8_backend_attends_like_float64_attention_over_fake_quantized_kv(backend_cls, window):
    cpu_kernels.paged_decode_attention_kernel(wait=True)
    if backend_cls is CpuBackend:
        assert cpu_kernels.paged_decode_attention_fp8_kernel() is not None, "the CPU FP8 kernel did not build"
    torch.manual_seed(0)
    pool = fp8_pool()
    old_k, old_v = (
        scaled_randn(16 * PAGE_SIZE, KV_HEADS, HEAD_DIM),
        scaled_randn(16 * PAGE_SIZE, KV_HEADS, HEAD_DIM),
    )
    k_scales = scales_from_amax(old_k.abs().amax(dim=(0, 2)))
    v_scales = scales_from_amax(old_v.abs().amax(dim=(0, 2)))
    pool.set_scales(k_scales[None], v_scales[None])
    all_slots = torch.arange(16 * PAGE_SIZE)
    pool.store(0, all_slots, old_k, old_v)
    step = make_step(MIXED_ROWS, MIXED_PAGES)
    num_tokens = len(step.token_ids)
    q = torch.randn(num_tokens, HEADS, HEAD_DIM) / HEAD_MAGNITUDES.repeat_interleave(HEADS // KV_HEADS).view(
        -1, 1
    )
    k, v = scaled_randn(num_tokens, KV_HEADS, HEAD_DIM), scaled_randn(num_tokens, KV_HEADS, HEAD_DIM)
    backend = backend_cls(
        device="cpu",
        page_size=PAGE_SIZE,
        max_num_seqs=8,
        max_pages_per_seq=6,
        sliding_window=window,
        kv_dtype=FP8_DTYPE,
    )
    metadata = backend.prepare(step)
    if backend_cls is CpuBackend:
        assert metadata.decode_kernel is cpu_kernels.paged_decode_attention_fp8_kernel()
    out = backend.forward(0, q, k, v, pool, metadata, HEAD_DIM**-0.5)
    # The reference: every slot's K/V as a store-then-read round trip gives them back.
    slots = torch.tensor(step.slot_mapping)
    keys, values = fake_quantize_fp8(old_k, k_scales), fake_quantize_fp8(old_v, v_scales)
    keys[slots], values[slots] = fake_quantize_fp8(k, k_scales), fake_quantize_fp8(v, v_scales)
    k_pool, _ = pool.layer(0)
    assert torch.equal(k_pool[slots].view(torch.uint8), quantize_fp8(k, k_scales).view(torch.uint8))
    expected = reference_attention_dequantized(
        q, keys.double(), values.double(), step, HEAD_DIM**-0.5, window
    )
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-4)
    # ... and the scales matter: the same bytes read with unit scales give something else entirely.
    pool.set_scales(torch.ones(1, KV_HEADS), torch.ones(1, KV_HEADS))
    wrong = backend.forward(0, q, None, None, pool, backend.prepare(step), HEAD_DIM**-0.5)
    assert not torch.allclose(wrong.double(), expected, rtol=1e-2, atol=1e-2)


def test_fused_rotary_fp8_write_stores_the_bytes_the_torch_store_does():
    cpu_kernels.paged_decode_attention_kernel(wait=True)
    fused = cpu_kernels.rotary_write_kv_fp8_kernel()
    assert fused is not None
    from hearth.model.rotary import apply_rotary

    torch.manual_seed(1)
    n = 7
    qkv = torch.randn(n, (HEADS + 2 * KV_HEADS) * HEAD_DIM) * 50
    angles = torch.rand(n, HEAD_DIM // 2) * 3
    cos, sin = angles.cos(), angles.sin()
    slots = torch.tensor([3, 9, 17, 0, 40, 41, 63])
    fused_pool, torch_pool = fp8_pool(), fp8_pool()
    scales = (torch.tensor([[0.05, 0.3]]), torch.tensor([[0.2, 0.01]]))
    fused_pool.set_scales(*scales)
    torch_pool.set_scales(*scales)
    q = fused(qkv, cos, sin, HEADS, *fused_pool.layer(0), slots, *fused_pool.kv_scales(0))
    q_ref, k_ref, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    q_ref = apply_rotary(q_ref.reshape(n, HEADS, HEAD_DIM), cos, sin)
    k_ref = apply_rotary(k_ref.reshape(n, KV_HEADS, HEAD_DIM), cos, sin)
    torch_pool.store(0, slots, k_ref, v.reshape(n, KV_HEADS, HEAD_DIM))
    torch.testing.assert_close(q, q_ref, rtol=1e-5, atol=1e-4)
    for fused_half, torch_half in zip(fused_pool.layer(0), torch_pool.layer(0)):
        got, want = fused_half[slots].float(), torch_half[slots].float()
        # Rotation in float32 may differ by an ulp, which can move a value to the neighbouring FP8 step.
        assert (got != want).float().mean() < 0.01
        torch.testing.assert_close(got, want, rtol=0.07, atol=0.02)


def test_checkpoint_scale_names_and_shapes():
    assert kv_scale_target("model.layers.3.self_attn.k_scale") == (3, "k")
    assert kv_scale_target("model.layers.0.self_attn.v_proj.v_scale") == (0, "v")
    assert kv_scale_target("model.layers.1.self_attn.attn.k_scale") == (1, "k")
    assert kv_scale_target("model.layers.1.self_attn.k_proj.weight_scale") is None
    assert kv_scale_target("model.layers.1.self_attn.k_proj.weight") is None
    layout = KVLayout(2, 2, 8, 4, FP8_DTYPE)
    found = {
        (0, "k"): torch.tensor(0.5),
        (0, "v"): torch.tensor([0.1, 0.2]),
        (1, "k"): torch.tensor([2.0]),
        (1, "v"): torch.tensor(3.0),
    }
    k, v = scales_from_checkpoint(found, layout)
    assert k.tolist() == [[0.5, 0.5], [2.0, 2.0]]
    torch.testing.assert_close(v, torch.tensor([[0.1, 0.2], [3.0, 3.0]]))
    del found[(1, "v")]
    with pytest.raises(ValueError, match="no v_scale for layer 1"):
        scales_from_checkpoint(found, layout)
    assert scales_from_checkpoint({}, layout) is None
