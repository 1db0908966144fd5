"""Every Triton kernel against its torch reference: under the interpreter on CPU, natively on a GPU."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.triton

from hearth.model.rotary import apply_rotary  # noqa: E402
from hearth.ops.triton.attention import paged_attention, paged_decode  # noqa: E402
from hearth.ops.triton.elementwise import rms_norm, rotary_write_kv, silu_and_mul  # noqa: E402
from hearth.ops.triton.page_tags import check_page_tags, check_page_tags_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_paged(context_lens: list[int], kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype):
    """Random K/V for each row's context, scattered over shuffled pages; returns pools, table, dense copies."""
    gen = torch.Generator().manual_seed(0)
    pages_per_row = [-(-n // page_size) for n in context_lens]
    num_pages = sum(pages_per_row) + 3
    order = torch.randperm(num_pages, generator=gen).tolist()
    k_pool = torch.zeros(num_pages * page_size, kv_heads, head_dim, dtype=dtype)
    v_pool = torch.zeros_like(k_pool)
    table = torch.zeros(len(context_lens), max(pages_per_row) + 2, dtype=torch.long)
    dense = []
    for row, n in enumerate(context_lens):
        keys = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
        values = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
        pages = [order.pop() for _ in range(pages_per_row[row])]
        table[row, : len(pages)] = torch.tensor(pages)
        for pos in range(n):
            slot = pages[pos // page_size] * page_size + pos % page_size
            k_pool[slot], v_pool[slot] = keys[pos], values[pos]
        dense.append((keys, values))
    return k_pool, v_pool, table, dense


def reference_attention(q, dense, query_lens, scale, window=None, k_scale=None, v_scale=None):
    out, start = [], 0
    for (keys, values), query_len in zip(dense, query_lens):
        keys, values = keys.double(), values.double()
        if k_scale is not None:
            keys = keys * k_scale.double()[None, :, None]
            values = values * v_scale.double()[None, :, None]
        n = keys.shape[0]
        group = q.shape[1] // keys.shape[1]
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        rows = q[start : start + query_len].double()
        scores = torch.einsum("qhd,khd->hqk", rows, keys) * scale
        query_pos = torch.arange(n - query_len, n)[:, None]
        key_pos = torch.arange(n)[None, :]
        allowed = key_pos <= query_pos
        if window:
            allowed &= key_pos > query_pos - window
        scores = scores.masked_fill(~allowed, -math.inf)
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), values))
        start += query_len
    return torch.cat(out)


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (4, 1)])
def test_paged_attention_mixed_rows_matches_reference(heads: int, kv_heads: int, window: int | None) -> None:
    head_dim, page_size, scale = 24, 4, 0.3  # head_dim not a power of two: the padded lanes are masked
    context_lens, query_lens = [1, 9, 21, 40], [1, 1, 21, 5]  # decode rows, a full prefill, an extend chunk
    k_pool, v_pool, table, dense = make_paged(context_lens, kv_heads, head_dim, page_size, torch.float32)
    q = torch.randn(sum(query_lens), heads, head_dim, generator=torch.Generator().manual_seed(1))
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()])
    out = paged_attention(
        q.to(DEVICE),
        k_pool.to(DEVICE),
        v_pool.to(DEVICE),
        table.to(DEVICE),
        starts.to(DEVICE),
        torch.tensor(context_lens, device=DEVICE),
        max(query_lens),
        scale,
        page_size,
        sliding_window=window,
    )
    expected = reference_attention(q, dense, query_lens, scale, window)
    torch.testing.assert_close(out.cpu().double(), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("num_splits", [None, 1, 3])
@pytest.mark.parametrize("window", [None, 50])
def test_split_k_decode_matches_reference(num_splits: int | None, window: int | None) -> None:
    heads, kv_heads, head_dim, page_size, scale = 6, 2, 16, 8, 0.25
    context_lens = [3, 130, 300]
    k_pool, v_pool, table, dense = make_paged(context_lens, kv_heads, head_dim, page_size, torch.float32)
    q = torch.randn(len(context_lens), heads, head_dim, generator=torch.Generator().manual_seed(2))
    out = paged_decode(
        q.to(DEVICE),
        k_pool.to(DEVICE),
        v_pool.to(DEVICE),
        table.to(DEVICE),
        torch.tensor(context_lens, device=DEVICE),
        max(context_lens),
        scale,
        page_size,
        sliding_window=window,
        num_splits=num_splits,
    )
    expected = reference_attention(q, dense, [1] * len(context_lens), scale, window)
    torch.testing.assert_close(out.cpu().double(), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("num_splits", [1, 4, 16])
@pytest.mark.parametrize("window", [None, 50])
def test_per_row_split_decode_ignores_the_host_length_bound(num_splits: int, window: int | None) -> None:
    """What a CUDA graph captures: splits cut per row on the device; `max_seq_len` is a stale bound
    (here far too small) and must not matter."""
    heads, kv_heads, head_dim, page_size, scale = 6, 2, 16, 8, 0.25
    context_lens = [1, 3, 130, 300]
    k_pool, v_pool, table, dense = make_paged(context_lens, kv_heads, head_dim, page_size, torch.float32)
    q = torch.randn(len(context_lens), heads, head_dim, generator=torch.Generator().manual_seed(5))
    out = paged_decode(
        q.to(DEVICE), k_pool.to(DEVICE), v_pool.to(DEVICE), table.to(DEVICE),
        torch.tensor(context_lens, device=DEVICE), 1, scale, page_size, sliding_window=window,
        num_splits=num_splits, per_row_splits=True,
    )  # fmt: skip
    expected = reference_attention(q, dense, [1] * len(context_lens), scale, window)
    torch.testing.assert_close(out.cpu().double(), expected, atol=2e-5, rtol=2e-5)


def test_fp8_pool_is_dequantized_with_per_head_scales() -> None:
    heads, kv_heads, head_dim, page_size, scale = 4, 2, 16, 4, 0.25
    context_lens, query_lens = [12, 20], [1, 6]
    fp8 = torch.float8_e4m3fn
    k_pool, v_pool, table, dense = make_paged(context_lens, kv_heads, head_dim, page_size, fp8)
    k_scale, v_scale = torch.tensor([0.5, 2.0]), torch.tensor([1.5, 0.25])
    q = torch.randn(sum(query_lens), heads, head_dim, generator=torch.Generator().manual_seed(3))
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()])
    args = (k_pool.to(DEVICE), v_pool.to(DEVICE), table.to(DEVICE))
    lens = torch.tensor(context_lens, device=DEVICE)
    out = paged_attention(
        q.to(DEVICE),
        *args,
        starts.to(DEVICE),
        lens,
        max(query_lens),
        scale,
        page_size,
        k_scale=k_scale.to(DEVICE),
        v_scale=v_scale.to(DEVICE),
    )
    expected = reference_attention(q, dense, query_lens, scale, k_scale=k_scale, v_scale=v_scale)
    torch.testing.assert_close(out.cpu().double(), expected, atol=1e-4, rtol=1e-4)
    unscaled = reference_attention(q, dense, query_lens, scale)
    assert not torch.allclose(out.cpu().double(), unscaled, atol=1e-2)  # the scales were applied
    decode_q = q[[0]]
    decoded = paged_decode(
        decode_q.to(DEVICE),
        *args[:2],
        table[:1].to(DEVICE),
        lens[:1],
        12,
        scale,
        page_size,
        k_scale=k_scale.to(DEVICE),
        v_scale=v_scale.to(DEVICE),
    )
    torch.testing.assert_close(decoded.cpu().double(), expected[[0]], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_with_and_without_residual(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(4)
    x, residual = torch.randn(5, 48, generator=gen).to(dtype), torch.randn(5, 48, generator=gen).to(dtype)
    weight = torch.randn(48, generator=gen).to(dtype)

    def reference(v: torch.Tensor) -> torch.Tensor:
        v32 = v.float()
        return weight * (v32 * torch.rsqrt(v32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)

    out, summed = rms_norm(x.to(DEVICE), weight.to(DEVICE), 1e-6, residual.to(DEVICE))
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(summed.cpu(), x + residual, **tol)
    torch.testing.assert_close(out.cpu(), reference(x + residual), **tol)
    out, summed = rms_norm(x.to(DEVICE), weight.to(DEVICE), 1e-6)
    torch.testing.assert_close(out.cpu(), reference(x), **tol)


def test_silu_and_mul() -> None:
    x = torch.randn(3, 2 * 40, generator=torch.Generator().manual_seed(5))
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(silu_and_mul(x.to(DEVICE)).cpu(), torch.nn.functional.silu(gate) * up)


def test_rotary_write_kv_matches_torch_rotary_and_writes_the_slots() -> None:
    gen = torch.Generator().manual_seed(6)
    heads, kv_heads, head_dim, tokens = 4, 2, 16, 5
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen)
    angles = torch.rand(tokens, head_dim // 2, generator=gen) * 6
    cos, sin = angles.cos(), angles.sin()
    k_pool = torch.zeros(32, kv_heads, head_dim)
    v_pool = torch.zeros_like(k_pool)
    slots = torch.tensor([3, 17, 4, 30, 9])
    k_dev, v_dev = k_pool.to(DEVICE), v_pool.to(DEVICE)
    q = rotary_write_kv(qkv.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE), heads, k_dev, v_dev, slots.to(DEVICE))
    q_ref, k_ref, v_ref = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    torch.testing.assert_close(q.cpu(), apply_rotary(q_ref.view(tokens, heads, head_dim), cos, sin))
    torch.testing.assert_close(
        k_dev.cpu()[slots], apply_rotary(k_ref.reshape(tokens, kv_heads, head_dim), cos, sin)
    )
    torch.testing.assert_close(v_dev.cpu()[slots], v_ref.reshape(tokens, kv_heads, head_dim))
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[slots] = False
    assert k_dev.cpu()[untouched].abs().sum() == 0


def test_page_tag_check_flags_exactly_the_rows_with_a_stale_page() -> None:
    pool_tags = torch.tensor([5, 1, 7, 2, 9, 4, 3, 8], dtype=torch.long)
    page_table = torch.tensor([[0, 2, 4, 0], [1, 3, 0, 0], [5, 6, 7, 1], [2, 0, 0, 0]])
    num_pages = torch.tensor([3, 2, 4, 1])
    expected = pool_tags[page_table].clone()
    expected[1, 1] += 1  # row 1 reads page 3, reallocated since
    expected[3, 2] += 1  # past row 3's pages: stale columns are not checked
    expected[2, 3] -= 1  # row 2's last page
    args = [t.to(DEVICE) for t in (page_table, expected, num_pages, pool_tags)]
    failed = check_page_tags(*args)
    assert failed.cpu().tolist() == [False, True, True, False]
    assert torch.equal(failed.cpu(), check_page_tags_reference(page_table, expected, num_pages, pool_tags))


@pytest.fixture
def triton_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """The model's layers and attention on the Triton kernels (interpreted on a CPU)."""
    monkeypatch.setenv("HEARTH_ATTENTION_BACKEND", "triton")
    monkeypatch.setenv("HEARTH_TRITON_KERNELS", "1")


def test_engine_on_triton_kernels_matches_transformers(tiny_model_factory, triton_everywhere) -> None:
    from hf_oracle import hf_greedy

    from hearth import LLM, SamplingParams

    model_dir = tiny_model_factory("llama")
    prompts = [[(7 * i + 3 * n) % 400 + 3 for i in range(n)] for n in (1, 9, 21)]
    llm = LLM(str(model_dir), dtype="float32", page_size=4, max_num_batched_tokens=16)
    assert llm.engine.worker.attention.name == "triton"
    results = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    for prompt, result in zip(prompts, results):
        assert result.token_ids == hf_greedy(model_dir, prompt, 6), f"prompt of {len(prompt)} tokens"
    again = llm.generate(prompts[2:], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert again[0].token_ids == results[2].token_ids and again[0].cached_tokens > 0  # prefix-cache hit
