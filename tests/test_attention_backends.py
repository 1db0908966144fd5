"""Attention backends: the registry, and every backend against attention computed slot by slot in float64."""

from __future__ import annotations

import pytest
import torch

from hearth.engine.forward_batch import ForwardBatch
from hearth.kv.pool import KVLayout, KVPool
from hearth.ops import cpu_kernels
from hearth.ops.attention import AttentionBackend, available_backends, get_backend, select_backend
from hearth.ops.attention.backend import AttentionKind
from hearth.ops.attention.cpu import MAX_KERNEL_ROW_TOKENS, CpuBackend
from hearth.ops.attention.torch_ref import TorchRefBackend
from hearth.ops.triton import triton_available


def _triton_backend() -> type[AttentionBackend]:
    pytest.importorskip("triton")
    return get_backend("triton")


PAGE_SIZE = 4
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8


def _device_for(backend_cls: type[AttentionBackend]) -> str:
    """Triton kernels run natively on a GPU when there is one (the interpreter on CPU otherwise)."""
    return "cuda" if backend_cls.name == "triton" and torch.cuda.is_available() else "cpu"


def _on_cpu(pool: KVPool) -> KVPool:
    copy = KVPool(pool.layout, pool.num_pages)
    copy.storage.copy_(pool.storage.cpu())
    return copy


def test_registry_selects_by_device_and_honours_the_override(monkeypatch):
    assert {"cpu", "torch_ref", "triton"} <= set(available_backends())
    monkeypatch.delenv("HEARTH_ATTENTION_BACKEND", raising=False)
    assert select_backend("cpu") is CpuBackend
    assert select_backend("cuda").name == ("triton" if triton_available() else "torch_ref")
    assert select_backend("meta") is TorchRefBackend
    monkeypatch.setenv("HEARTH_ATTENTION_BACKEND", "torch_ref")
    assert select_backend("cpu") is TorchRefBackend
    assert select_backend("cpu", override="cpu") is CpuBackend
    with pytest.raises(
        ValueError, match="unknown attention backend 'flash'; choose one of cpu, torch_ref, triton"
    ):
        get_backend("flash")


def make_step(rows: list[tuple[int, int]], page_tables: list[list[int]]) -> ForwardBatch:
    """rows: (context_len after the step, query tokens); decode rows (1 token) first."""
    width = max(len(pages) for pages in page_tables)
    query_start_loc, slots, positions = [0], [], []
    for (context_len, query_len), pages in zip(rows, page_tables):
        for position in range(context_len - query_len, context_len):
            positions.append(position)
            slots.append(pages[position // PAGE_SIZE] * PAGE_SIZE + position % PAGE_SIZE)
        query_start_loc.append(query_start_loc[-1] + query_len)
    num_decode_rows = 0
    while num_decode_rows < len(rows) and rows[num_decode_rows][1] == 1:
        num_decode_rows += 1
    return ForwardBatch(
        token_ids=[0] * len(slots),
        positions=positions,
        query_start_loc=query_start_loc,
        seq_lens=[context_len for context_len, _ in rows],
        num_decode_rows=num_decode_rows,
        page_table=[p for pages in page_tables for p in pages + [0] * (width - len(pages))],
        page_table_width=width,
        slot_mapping=slots,
        logits_indices=[],
        sampling=[],
    )


def reference_attention(
    q, pool: KVPool, step: ForwardBatch, scale: float, window: int | None
) -> torch.Tensor:
    """Per query token: softmax over its row's keys at positions (p - window, p], read slot by slot."""
    k_pool, v_pool = (t.double() for t in pool.layer(0))
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
                keys, values = k_pool[slots, kv_head], v_pool[slots, kv_head]
                weights = torch.softmax(keys @ q[t, head].double() * scale, dim=0)
                out[t, head] = weights @ values
    return out


MIXED_ROWS = [(9, 1), (3, 1), (14, 1), (7, 7), (13, 5), (6, 2)]  # decodes, a whole prompt, chunks
MIXED_PAGES = [[5, 2, 11], [8], [0, 14, 3, 9], [4, 15], [1, 6, 12, 13], [7, 10]]


@pytest.mark.parametrize(
    "backend_cls", [TorchRefBackend, CpuBackend, pytest.param(_triton_backend, marks=pytest.mark.triton)]
)
@pytest.mark.parametrize("window", [None, 5])
def test_backend_stores_new_kv_and_attends_like_the_reference(backend_cls, window):
    if backend_cls is _triton_backend:
        backend_cls = _triton_backend()
    cpu_kernels.paged_decode_attention_kernel(
        wait=True
    )  # the CPU backend's decode rows take the kernel if it builds
    device = _device_for(backend_cls)
    torch.manual_seed(0)
    pool = KVPool(KVLayout(1, KV_HEADS, HEAD_DIM, PAGE_SIZE, torch.float32), 16, device=device)
    pool.storage.copy_(torch.randn(pool.storage.shape))
    step = make_step(MIXED_ROWS, MIXED_PAGES)
    num_tokens = len(step.token_ids)
    q = torch.randn(num_tokens, HEADS, HEAD_DIM)
    k, v = torch.randn(num_tokens, KV_HEADS, HEAD_DIM), torch.randn(num_tokens, KV_HEADS, HEAD_DIM)
    backend: AttentionBackend = backend_cls(
        device=device, page_size=PAGE_SIZE, max_num_seqs=8, max_pages_per_seq=6, sliding_window=window
    )
    metadata = backend.prepare(step)
    out = backend.forward(0, q.to(device), k.to(device), v.to(device), pool, metadata, HEAD_DIM**-0.5).cpu()
    pool = _on_cpu(pool)
    k_pool, v_pool = pool.layer(0)
    slots = torch.tensor(step.slot_mapping)
    torch.testing.assert_close(k_pool[slots], k, rtol=0, atol=0)
    torch.testing.assert_close(v_pool[slots], v, rtol=0, atol=0)
    expected = reference_attention(q, pool, step, HEAD_DIM**-0.5, window)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "backend_cls", [TorchRefBackend, CpuBackend, pytest.param(_triton_backend, marks=pytest.mark.triton)]
)
def test_slots_outside_the_context_never_reach_the_output(backend_cls):
    """A fresh pool may hold NaN anywhere; only the slots of each row's context may be read."""
    if backend_cls is _triton_backend:
        backend_cls = _triton_backend()
    cpu_kernels.paged_decode_attention_kernel(wait=True)
    torch.manual_seed(0)
    pool = KVPool(KVLayout(1, KV_HEADS, HEAD_DIM, PAGE_SIZE, torch.float32), 16)
    pool.storage.fill_(float("nan"))
    step = make_step(MIXED_ROWS, MIXED_PAGES)
    k_pool, v_pool = pool.layer(0)
    for row, (context_len, _) in enumerate(MIXED_ROWS):  # the context the step's rows read
        pages = MIXED_PAGES[row]
        for position in range(context_len):
            slot = pages[position // PAGE_SIZE] * PAGE_SIZE + position % PAGE_SIZE
            k_pool[slot], v_pool[slot] = torch.randn(KV_HEADS, HEAD_DIM), torch.randn(KV_HEADS, HEAD_DIM)
    num_tokens = len(step.token_ids)
    q = torch.randn(num_tokens, HEADS, HEAD_DIM)
    device = _device_for(backend_cls)
    device_pool = KVPool(pool.layout, pool.num_pages, device=device)
    device_pool.storage.copy_(pool.storage)
    backend = backend_cls(device=device, page_size=PAGE_SIZE, max_num_seqs=8, max_pages_per_seq=6)
    out = backend.forward(
        0, q.to(device), None, None, device_pool, backend.prepare(step), HEAD_DIM**-0.5
    ).cpu()
    assert not out.isnan().any()
    torch.testing.assert_close(
        out.double(), reference_attention(q, pool, step, HEAD_DIM**-0.5, None), rtol=1e-5, atol=1e-5
    )


def test_prepare_writes_the_page_table_into_one_fixed_buffer():
    backend = TorchRefBackend(device="cpu", page_size=PAGE_SIZE, max_num_seqs=8, max_pages_per_seq=6)
    first = backend.prepare(make_step(MIXED_ROWS, MIXED_PAGES))
    second = backend.prepare(make_step([(5, 1), (2, 1)], [[3, 4], [9]]))
    assert first.page_table.data_ptr() == second.page_table.data_ptr() == backend.page_table_buffer.data_ptr()
    assert second.page_table.shape == (2, 6) and second.page_table.is_contiguous()
    assert second.page_table[:, :2].tolist() == [[3, 4], [9, 0]]
    assert second.decode_mask.shape == (2, 2 * PAGE_SIZE)
    with pytest.raises(ValueError, match="exceeds the attention buffers"):
        backend.prepare(make_step([(40, 1)], [list(range(10))]))


def test_torch_reference_keeps_every_tensor_on_its_device():
    """On the meta device any tensor created on the CPU by mistake meets a meta one and raises."""
    pool = KVPool(KVLayout(1, KV_HEADS, HEAD_DIM, PAGE_SIZE, torch.float32), 16, device="meta")
    backend = TorchRefBackend(
        device="meta", page_size=PAGE_SIZE, max_num_seqs=8, max_pages_per_seq=6, sliding_window=5
    )
    step = make_step(MIXED_ROWS, MIXED_PAGES)
    num_tokens = len(step.token_ids)
    q = torch.empty(num_tokens, HEADS, HEAD_DIM, device="meta")
    k = torch.empty(num_tokens, KV_HEADS, HEAD_DIM, device="meta")
    metadata = backend.prepare(step)
    assert all(
        t.device.type == "meta" for t in (metadata.slot_mapping, metadata.page_table, metadata.decode_mask)
    )
    out = backend.forward(0, q, k, k, pool, metadata, 0.5)
    assert out.device.type == "meta" and out.shape == q.shape


# Speculative decoding's steady state: decode rows, then verify rows of 1 + K queries (K = 4, 2, 7).
VERIFY_ROWS = [(9, 1), (14, 1), (13, 5), (7, 3), (22, 8)]
VERIFY_PAGES = [[5, 2, 11], [0, 14, 3, 9], [1, 6, 12, 13], [4, 15], [7, 10, 8, 16, 17, 18]]
# A prefill chunk longer than MAX_KERNEL_ROW_TOKENS next to a verify row: the step keeps the torch path.
LONG_ROWS = [(9, 1), (13, 5), (20, 17)]
LONG_PAGES = [[5, 2, 11], [1, 6, 12, 13], [4, 15, 7, 10, 8]]


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize(
    ("rows", "pages", "through_kernel"), [(VERIFY_ROWS, VERIFY_PAGES, True), (LONG_ROWS, LONG_PAGES, False)]
)
def test_cpu_multi_token_rows_take_the_decode_kernel_and_attend_causally(rows, pages, through_kernel, window):
    """Every row short: one decode-kernel query per token, each causal within its row (the reference reads
    slot by slot); a long row anywhere: the step keeps the prefill path, with the same result."""
    if cpu_kernels.paged_decode_attention_kernel(wait=True) is None:
        pytest.skip("the CPU kernels did not build here")
    assert max(q for _, q in LONG_ROWS) > MAX_KERNEL_ROW_TOKENS >= max(q for _, q in VERIFY_ROWS)
    torch.manual_seed(1)
    pool = KVPool(KVLayout(1, KV_HEADS, HEAD_DIM, PAGE_SIZE, torch.float32), 19)
    pool.storage.copy_(torch.randn(pool.storage.shape))
    step = make_step(rows, pages)
    num_tokens = len(step.token_ids)
    q = torch.randn(num_tokens, HEADS, HEAD_DIM)
    k, v = torch.randn(num_tokens, KV_HEADS, HEAD_DIM), torch.randn(num_tokens, KV_HEADS, HEAD_DIM)
    backend = CpuBackend(
        device="cpu", page_size=PAGE_SIZE, max_num_seqs=8, max_pages_per_seq=8, sliding_window=window
    )
    metadata = backend.prepare(step)
    assert (getattr(metadata, "token_rows", None) is not None) == through_kernel
    out = backend.forward(0, q, k, v, pool, metadata, HEAD_DIM**-0.5)
    expected = reference_attention(q, pool, step, HEAD_DIM**-0.5, window)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    # The same step through the prefill path (the multi-token-row kernel off) agrees with it.
    backend.verify_rows_kernel = False
    reference_path = backend.prepare(step)
    assert getattr(reference_path, "token_rows", None) is None
    torch.testing.assert_close(
        backend.forward(0, q, None, None, pool, reference_path, HEAD_DIM**-0.5), out, rtol=1e-5, atol=1e-5
    )


def reference_by_first_key(
    q, pool: KVPool, layer: int, step: ForwardBatch, scale: float, first_key
) -> torch.Tensor:
    """Per query token at position p: softmax over its row's keys at positions [first_key(p), p], slot by slot."""
    k_pool, v_pool = (t.double() for t in pool.layer(layer))
    width = step.page_table_width
    out = torch.empty(q.shape, dtype=torch.float64)
    for row in range(len(step.seq_lens)):
        pages = step.page_table[row * width : (row + 1) * width]
        for t in range(step.query_start_loc[row], step.query_start_loc[row + 1]):
            p = step.positions[t]
            slots = [pages[k // PAGE_SIZE] * PAGE_SIZE + k % PAGE_SIZE for k in range(first_key(p), p + 1)]
            for head in range(HEADS):
                kv_head = head // (HEADS // KV_HEADS)
                keys, values = k_pool[slots, kv_head], v_pool[slots, kv_head]
                weights = torch.softmax(keys @ q[t, head].double() * scale, dim=0)
                out[t, head] = weights @ values
    return out


@pytest.mark.parametrize("backend_cls", [TorchRefBackend, CpuBackend])
@pytest.mark.parametrize(("rows", "pages"), [(MIXED_ROWS, MIXED_PAGES), (VERIFY_ROWS, VERIFY_PAGES)])
def test_each_layer_attends_as_its_kind_says(backend_cls, rows, pages):
    """Full, sliding-window and chunked-local layers in one model (Gemma 3, Llama 4): each layer of a step
    reads its own kind's keys, through the prefill path, the decode kernel and its multi-token rows."""
    cpu_kernels.paged_decode_attention_kernel(wait=True)
    kinds = (
        AttentionKind(),
        AttentionKind(sliding_window=5),
        AttentionKind(chunk_size=6),
        AttentionKind(chunk_size=4),
    )
    first_keys = (lambda p: 0, lambda p: max(0, p - 4), lambda p: p // 6 * 6, lambda p: p // 4 * 4)
    torch.manual_seed(2)
    pool = KVPool(KVLayout(len(kinds), KV_HEADS, HEAD_DIM, PAGE_SIZE, torch.float32), 19)
    pool.storage.copy_(torch.randn(pool.storage.shape))
    step = make_step(rows, pages)
    backend = backend_cls(
        device="cpu", page_size=PAGE_SIZE, max_num_seqs=8, max_pages_per_seq=8, layer_kinds=kinds
    )
    metadata = backend.prepare(step)
    num_tokens = len(step.token_ids)
    for layer, first_key in enumerate(first_keys):
        q = torch.randn(num_tokens, HEADS, HEAD_DIM)
        out = backend.forward(layer, q, None, None, pool, metadata, HEAD_DIM**-0.5)
        expected = reference_by_first_key(q, pool, layer, step, HEAD_DIM**-0.5, first_key)
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_triton_refuses_chunked_attention_it_has_no_kernel_for():
    backend_cls = _triton_backend()
    with pytest.raises(ValueError, match="chunked local attention runs on the cpu and torch_ref backends"):
        backend_cls(
            device="cpu", page_size=PAGE_SIZE, max_num_seqs=8, max_pages_per_seq=8,
            layer_kinds=(AttentionKind(), AttentionKind(chunk_size=8)),
        )  # fmt: skip
