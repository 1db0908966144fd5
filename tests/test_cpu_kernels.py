"""The compiled CPU kernels against torch (paged decode attention against gather + SDPA, the bf16
skinny linear against a float64 product) and in the engine against transformers."""

from __future__ import annotations

import pytest
import torch
from hf_oracle import hf_greedy

from hearth import LLM, SamplingParams
from hearth.engine.forward_batch import ForwardBatch
from hearth.kv.pool import KVLayout, KVPool
from hearth.model.layers import Linear
from hearth.ops import cpu_kernels
from hearth.ops.attention.cpu import CpuBackend
from hearth.ops.attention.torch_ref import TorchRefBackend

kernel = cpu_kernels.paged_decode_attention_kernel(wait=True)
pytestmark = pytest.mark.skipif(kernel is None, reason="no C++ toolchain for torch extensions here")


def decode_step(lens: list[int], table: torch.Tensor) -> ForwardBatch:
    """A step of decode rows only, over the given page table (the K/V are already in the pool)."""
    n = len(lens)
    return ForwardBatch(
        token_ids=[0] * n,
        positions=[length - 1 for length in lens],
        query_start_loc=list(range(n + 1)),
        seq_lens=lens,
        num_decode_rows=n,
        page_table=table.flatten().tolist(),
        page_table_width=table.shape[1],
        slot_mapping=[0] * n,
        logits_indices=[],
        sampling=[],
    )


@pytest.mark.parametrize("heads,kv_heads,window", [(8, 4, None), (4, 1, None), (6, 6, None), (8, 2, 37)])
def test_kernel_matches_gather_and_sdpa(heads, kv_heads, window):
    torch.manual_seed(heads * 10 + kv_heads)
    n, dim, page_size, num_pages, max_pages = 7, 32, 8, 64, 8
    pool = KVPool(KVLayout(1, kv_heads, dim, page_size, torch.float32), num_pages)
    pool.storage.normal_()
    lens = [1, 5, 8, 9, 40, 63, 64]
    table = torch.randperm(num_pages)[: n * max_pages].view(n, max_pages)
    step = decode_step(lens, table)
    q = torch.randn(n, heads, dim)
    options = dict(
        device="cpu", page_size=page_size, max_num_seqs=16, max_pages_per_seq=12, sliding_window=window
    )
    cpu, reference = CpuBackend(**options), TorchRefBackend(**options)
    cpu_metadata = cpu.prepare(step)
    assert cpu_metadata.decode_kernel is not None and cpu_metadata.decode_mask is None
    fast = cpu.forward(0, q, None, None, pool, cpu_metadata, dim**-0.5)
    slow = reference.forward(0, q, None, None, pool, reference.prepare(step), dim**-0.5)
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)


def test_engine_with_kernel_matches_transformers(tiny_model_factory):
    model_dir = tiny_model_factory("qwen3")
    prompts = [[(7 * i + 3) % 500 for i in range(n)] for n in (5, 19, 33)]
    results = LLM(str(model_dir), dtype="float32", page_size=8, device="cpu").generate(
        prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    )
    assert cpu_kernels.paged_decode_attention_kernel() is not None
    for prompt, result in zip(prompts, results):
        assert result.token_ids == hf_greedy(model_dir, prompt, 20)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17])
@pytest.mark.parametrize("out_features,in_features", [(64, 32), (37, 13), (300, 136), (5, 7)])
def test_bf16_skinny_linear_matches_float64(rows, out_features, in_features):
    skinny = cpu_kernels.bf16_skinny_linear_kernel()
    torch.manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features).to(torch.bfloat16)
    bias = torch.randn(out_features)
    x = torch.randn(rows + 2, in_features)[1:-1]  # a view: row stride kept, rows offset
    expected = x.double() @ weight.double().t()
    torch.testing.assert_close(skinny(x, weight).double(), expected, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(
        skinny(x, weight, bias).double(), expected + bias.double(), rtol=1e-5, atol=1e-4
    )


def test_bf16_skinny_linear_rejects_wrong_inputs():
    skinny = cpu_kernels.bf16_skinny_linear_kernel()
    with pytest.raises(RuntimeError, match="bfloat16"):
        skinny(torch.randn(1, 8), torch.randn(4, 8))
    with pytest.raises(RuntimeError, match="features"):
        skinny(torch.randn(1, 8), torch.randn(4, 6).to(torch.bfloat16))


@pytest.mark.parametrize(
    "arch,overrides", [("llama", {"tie_word_embeddings": True}), ("qwen2", {}), ("qwen3", {})]
)
def test_bf16_checkpoint_keeps_bf16_weights_and_matches_transformers(tiny_model_factory, arch, overrides):
    model_dir = tiny_model_factory(arch, weights_dtype="bfloat16", **overrides)
    llm = LLM(str(model_dir), dtype="float32", page_size=8, device="cpu")
    linears = [m for m in llm.engine.model.modules() if isinstance(m, Linear)]
    # Every projection runs from its bf16 copy at decode batch sizes; no float32 copy is kept beside the packed one.
    assert linears and all(m.prepared.bf16 is not None for m in linears)
    assert all(m.weight is None for m in linears if m.prepared.packed is not None)
    assert llm.engine.model.lm_head_weights.bf16 is not None
    prompts = [[(11 * i + 5) % 500 for i in range(n)] for n in (3, 17, 30, 9, 21, 4)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    together = llm.generate(prompts, params)  # prefill through oneDNN, decode of 6 rows through the kernel
    alone = llm.generate(prompts[:1], params)
    assert alone[0].token_ids == together[0].token_ids
    for prompt, result in zip(prompts, together):
        assert result.token_ids == hf_greedy(model_dir, prompt, 16)


@pytest.mark.parametrize("rows,hidden", [(1, 64), (5, 37), (33, 512)])
def test_rms_norm_kernel_matches_torch(monkeypatch, rows, hidden):
    from hearth.model.layers import RMSNorm

    torch.manual_seed(rows + hidden)
    norm = RMSNorm(hidden, 1e-6)
    with torch.no_grad():
        norm.weight.normal_()
    x, residual = torch.randn(rows, hidden), torch.randn(rows, hidden)
    fast_out, fast_sum = norm.add_and_norm(x, residual)
    fast_plain = norm(x)
    monkeypatch.setattr(cpu_kernels, "_rms_norm", None)
    monkeypatch.setattr("hearth.model.layers.rms_norm_kernel", lambda: None)
    ref_out, ref_sum = norm.add_and_norm(x, residual)
    torch.testing.assert_close(fast_sum, ref_sum, rtol=0, atol=0)
    torch.testing.assert_close(fast_out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast_plain, norm(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 16), (6, 1, 8), (8, 8, 64)])
def test_rotary_write_kv_matches_torch(heads, kv_heads, dim):
    from hearth.model.rotary import apply_rotary
    from hearth.ops.attention import write_kv

    torch.manual_seed(heads * dim)
    tokens, num_slots = 7, 40
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim)
    cos_sin = torch.randn(tokens, dim)
    cos, sin = cos_sin.chunk(2, dim=-1)  # views with a row stride of `dim`, as the model passes them
    slots = torch.randperm(num_slots)[:tokens]
    pools = [torch.zeros(num_slots, kv_heads, dim) for _ in range(4)]
    q = cpu_kernels.rotary_write_kv_kernel()(qkv, cos, sin, heads, pools[0], pools[1], slots)
    q_ref, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q_ref = apply_rotary(q_ref.view(tokens, heads, dim), cos, sin)
    k = apply_rotary(k.view(tokens, kv_heads, dim), cos, sin)
    write_kv(pools[2], pools[3], slots, k, v.view(tokens, kv_heads, dim))
    torch.testing.assert_close(q, q_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(pools[0], pools[2], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(pools[1], pools[3], rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_kernels.rotary_write_kv_kernel()(qkv, cos, sin, heads, pools[0], pools[1], slots + num_slots)
