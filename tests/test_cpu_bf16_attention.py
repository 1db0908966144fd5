"""The CPU backend's decode rows over a bfloat16 pool (a bf16 model, issue 11) take the compiled kernel,
which reads the pages in place, and attend as the slot-by-slot float64 reference does, to bf16 precision."""

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
    reference_attention,
)

from hearth.kv.pool import KVLayout, KVPool
from hearth.ops import cpu_kernels
from hearth.ops.attention.cpu import CpuBackend
from hearth.ops.attention.torch_ref import TorchRefBackend

DECODE_ROWS = [(9, 1), (3, 1), (14, 1), (1, 1)]
DECODE_PAGES = [[5, 2, 11], [8], [0, 14, 3, 9], [7]]


def bf16_pool_with_nan_outside(rows, pages) -> KVPool:
    """Every slot NaN except those of the rows' contexts: a read outside a context poisons the output."""
    pool = KVPool(KVLayout(1, KV_HEADS, HEAD_DIM, PAGE_SIZE, torch.bfloat16), 16)
    pool.storage.fill_(float("nan"))
    k_pool, v_pool = pool.layer(0)
    for row, (context_len, _) in enumerate(rows):
        for position in range(context_len):
            slot = pages[row][position // PAGE_SIZE] * PAGE_SIZE + position % PAGE_SIZE
            k_pool[slot] = torch.randn(KV_HEADS, HEAD_DIM).to(torch.bfloat16)
            v_pool[slot] = torch.randn(KV_HEADS, HEAD_DIM).to(torch.bfloat16)
    return pool


@pytest.mark.parametrize(("rows", "pages"), [(DECODE_ROWS, DECODE_PAGES), (MIXED_ROWS, MIXED_PAGES)])
@pytest.mark.parametrize("window", [None, 5])
def test_bf16_decode_kernel_reads_pages_in_place_and_matches(rows, pages, window):
    if cpu_kernels.paged_decode_attention_kernel(wait=True) is None:
        pytest.skip("the CPU kernels did not build here")
    torch.manual_seed(0)
    pool = bf16_pool_with_nan_outside(rows, pages)
    step = make_step(rows, pages)
    q = torch.randn(len(step.token_ids), HEADS, HEAD_DIM).to(torch.bfloat16)
    options = dict(
        device="cpu", page_size=PAGE_SIZE, max_num_seqs=8, max_pages_per_seq=6, sliding_window=window
    )
    backend = CpuBackend(dtype=torch.bfloat16, **options)
    metadata = backend.prepare(step)
    assert metadata.decode_kernel is not None and metadata.decode_mask is None  # the kernel, not the gather
    out = backend.forward(0, q, None, None, pool, metadata, HEAD_DIM**-0.5)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    expected = reference_attention(q, pool, step, HEAD_DIM**-0.5, window)
    # One bf16 rounding of the output (~2^-8 relative) on top of float32 arithmetic.
    torch.testing.assert_close(out.double(), expected, rtol=1e-2, atol=1e-2)
    # And within that rounding of the torch path it replaces.
    reference = TorchRefBackend(dtype=torch.bfloat16, **options)
    torch_out = reference.forward(0, q, None, None, pool, reference.prepare(step), HEAD_DIM**-0.5)
    torch.testing.assert_close(out.float(), torch_out.float(), rtol=1e-2, atol=1e-2)


def test_float32_models_keep_the_float32_kernel_and_other_pools_the_torch_path():
    if cpu_kernels.paged_decode_attention_kernel(wait=True) is None:
        pytest.skip("the CPU kernels did not build here")
    step = make_step(DECODE_ROWS, DECODE_PAGES)
    options = dict(device="cpu", page_size=PAGE_SIZE, max_num_seqs=8, max_pages_per_seq=6)
    assert CpuBackend(**options).prepare(step).decode_kernel is cpu_kernels.paged_decode_attention_kernel()
    # A float16 model has no kernel: decode gathers and masks.
    assert CpuBackend(dtype=torch.float16, **options).prepare(step).decode_mask is not None


@pytest.mark.parametrize("with_residual", [False, True])
def test_bf16_rms_norm_kernel_rounds_where_the_torch_path_does(with_residual):
    """The compiled RMSNorm on bf16 rows against the torch path (transformers' order of roundings):
    equal, or one bf16 ulp apart where a float32 sum taken in another order rounds the other way."""
    from hearth.model.layers import RMSNorm

    if cpu_kernels.paged_decode_attention_kernel(wait=True) is None or cpu_kernels.rms_norm_kernel() is None:
        pytest.skip("the CPU kernels did not build here")
    torch.manual_seed(0)
    norm = RMSNorm(512, 1e-6).to(torch.bfloat16)
    norm.weight.data.normal_(1.0, 0.2)
    x = (torch.randn(37, 512) * 3).to(torch.bfloat16)
    residual = torch.randn(37, 512).to(torch.bfloat16)
    assert norm._kernel_for(x) is cpu_kernels.rms_norm_kernel()
    if with_residual:
        (out, summed), (ref_out, ref_summed) = norm.add_and_norm(x, residual), (None, x + residual)
        ref_out = norm._norm(ref_summed)
        assert torch.equal(summed, ref_summed)
    else:
        out, ref_out = norm(x), norm._norm(x)
    assert out.dtype == torch.bfloat16
    ulp = ref_out.float().abs().clamp(min=1e-3) * 2.0**-7
    assert ((out.float() - ref_out.float()).abs() <= ulp).all()
    assert (out == ref_out).float().mean() > 0.95
