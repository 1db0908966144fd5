"""The compiled paged decode-attention kernel against the torch path (gather + SDPA), and in the engine."""

from __future__ import annotations

import pytest
import torch
from hf_oracle import hf_greedy

from hearth import LLM, SamplingParams
from hearth.ops import cpu_kernels
from hearth.ops.attention import AttentionContext, _decode_attention

kernel = cpu_kernels.paged_decode_attention_kernel(wait=True)
pytestmark = pytest.mark.skipif(kernel is None, reason="no C++ toolchain for torch extensions here")


def torch_path(monkeypatch, *args):
    monkeypatch.setattr(cpu_kernels, "_kernel", None)
    try:
        return _decode_attention(*args)
    finally:
        monkeypatch.setattr(cpu_kernels, "_kernel", kernel)


@pytest.mark.parametrize("heads,kv_heads,window", [(8, 4, None), (4, 1, None), (6, 6, None), (8, 2, 37)])
def test_kernel_matches_gather_and_sdpa(monkeypatch, heads, kv_heads, window):
    torch.manual_seed(heads * 10 + kv_heads)
    n, dim, page_size, num_pages = 7, 32, 8, 64
    k_pool = torch.randn(num_pages * page_size, kv_heads, dim)
    v_pool = torch.randn(num_pages * page_size, kv_heads, dim)
    lens = torch.tensor([1, 5, 8, 9, 40, 63, 64], dtype=torch.long)
    max_pages = 8
    table = torch.randperm(num_pages)[: n * max_pages].view(n, max_pages).contiguous()
    first = torch.zeros_like(lens) if window is None else (lens - window).clamp(min=0)
    ctx = AttentionContext(
        slot_mapping=torch.empty(0, dtype=torch.long),
        page_size=page_size,
        num_decode_tokens=n,
        decode_page_table=table,
        decode_context_lens=lens,
        decode_first_positions=first,
    )
    q = torch.randn(n, heads, dim)
    fast = _decode_attention(q, k_pool, v_pool, ctx, dim**-0.5, page_size)
    reference = torch_path(monkeypatch, q, k_pool, v_pool, ctx, dim**-0.5, page_size)
    torch.testing.assert_close(fast, reference, rtol=1e-5, atol=1e-5)


def test_engine_with_kernel_matches_transformers(tiny_model_factory):
    model_dir = tiny_model_factory("qwen3")
    prompts = [[(7 * i + 3) % 500 for i in range(n)] for n in (5, 19, 33)]
    results = LLM(str(model_dir), dtype="float32", page_size=8).generate(
        prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    )
    assert cpu_kernels.paged_decode_attention_kernel() is not None
    for prompt, result in zip(prompts, results):
        assert result.token_ids == hf_greedy(model_dir, prompt, 20)
