"""The compiled paged decode-attention kernels (float32, FP8 and bf16 pools) against attention computed slot by
slot in float64, at real head sizes (the vector loops take head dims that are multiples of 16) and at the
batch sizes, context lengths and thread counts that cut a sequence's keys into chunks merged after."""

from __future__ import annotations

import pytest
import torch

from hearth.ops import cpu_kernels

pytestmark = pytest.mark.skipif(
    cpu_kernels.paged_decode_attention_kernel(wait=True) is None,
    reason="no C++ toolchain for torch extensions",
)

PAGE_SIZE = 16


def _setup(seqs: list[tuple[int, int]], heads: int, kv_heads: int, dim: int):
    """Pools filled with NaN except each sequence's attended slots; pages handed out interleaved."""
    torch.manual_seed(0)
    max_pages = max(-(-length // PAGE_SIZE) for length, _ in seqs)
    num_slots = (len(seqs) * max_pages + 1) * PAGE_SIZE
    k = torch.full((num_slots, kv_heads, dim), float("nan"))
    v = torch.full((num_slots, kv_heads, dim), float("nan"))
    table = torch.zeros(len(seqs), max_pages, dtype=torch.int64)
    for page in range(max_pages):
        for row in range(len(seqs)):
            table[row, page] = 1 + page * len(seqs) + row  # page 0 stays NaN: never read
    for row, (length, first) in enumerate(seqs):
        for position in range(first, length):
            slot = int(table[row, position // PAGE_SIZE]) * PAGE_SIZE + position % PAGE_SIZE
            k[slot], v[slot] = torch.randn(kv_heads, dim), torch.randn(kv_heads, dim)
    q = torch.randn(len(seqs), heads, dim)
    return q, k, v, table


def _reference(q, k, v, table, seqs, scale):
    heads, kv_heads = q.shape[1], k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for row, (length, first) in enumerate(seqs):
        slots = [int(table[row, p // PAGE_SIZE]) * PAGE_SIZE + p % PAGE_SIZE for p in range(first, length)]
        for head in range(heads):
            kv_head = head // (heads // kv_heads)
            keys, values = k[slots, kv_head].double(), v[slots, kv_head].double()
            out[row, head] = torch.softmax(keys @ q[row, head].double() * scale, dim=0) @ values
    return out


CASES = [
    # (sequence (length, first attended position) list, heads, kv heads, head dim, threads)
    ([(700, 0)], 9, 3, 64, 2),  # batch 1, 3 KV heads on 2 threads: keys cut into chunks
    ([(300, 0)], 9, 3, 64, 3),  # chunks but only ~100 keys a chunk: not cut
    ([(1000, 0)], 6, 3, 128, 4),
    ([(517, 37)], 12, 3, 64, 2),  # a sliding window: the chunks start at the first attended key
    ([(600, 0), (455, 0)], 9, 3, 64, 4),  # 2 sequences x 3 KV heads on 4 threads
    ([(20, 0), (9, 0), (700, 0)], 8, 2, 64, 2),  # more sequences than threads
    ([(333, 0)], 8, 8, 64, 2),  # KV heads share evenly: no chunks
    ([(290, 0)], 4, 1, 48, 2),  # a head dim the vector loops take (48) with one KV head
    ([(300, 0)], 6, 3, 40, 2),  # a head dim they do not (40): the plain loops
]


@pytest.mark.parametrize("seqs,heads,kv_heads,dim,threads", CASES)
def test_float32_pool_attends_like_the_reference(seqs, heads, kv_heads, dim, threads):
    kernel = cpu_kernels.paged_decode_attention_kernel()
    q, k, v, table = _setup(seqs, heads, kv_heads, dim)
    lens = torch.tensor([length for length, _ in seqs])
    firsts = torch.tensor([first for _, first in seqs])
    scale = dim**-0.5
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = kernel(q, k, v, table, lens, firsts, PAGE_SIZE, scale)
    finally:
        torch.set_num_threads(before)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), _reference(q, k, v, table, seqs, scale), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seqs,heads,kv_heads,dim,threads", CASES[:5])
def test_fp8_and_bf16_pools_attend_like_the_reference(seqs, heads, kv_heads, dim, threads):
    q, k, v, table = _setup(seqs, heads, kv_heads, dim)
    lens = torch.tensor([length for length, _ in seqs])
    firsts = torch.tensor([first for _, first in seqs])
    scale = dim**-0.5
    k_scale, v_scale = torch.full((kv_heads,), 0.5), torch.full((kv_heads,), 0.25)
    k8, v8 = (k / k_scale[:, None]).to(torch.float8_e4m3fn), (v / v_scale[:, None]).to(torch.float8_e4m3fn)
    k16, v16 = k.to(torch.bfloat16), v.to(torch.bfloat16)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fp8 = cpu_kernels.paged_decode_attention_fp8_kernel()(
            q, k8, v8, k_scale, v_scale, table, lens, firsts, PAGE_SIZE, scale
        )
        bf16 = cpu_kernels.paged_decode_attention_bf16_kernel()(
            q, k16, v16, table, lens, firsts, PAGE_SIZE, scale
        )
    finally:
        torch.set_num_threads(before)
    fp8_keys, fp8_values = k8.float() * k_scale[:, None], v8.float() * v_scale[:, None]
    expected = _reference(q, fp8_keys, fp8_values, table, seqs, scale)
    torch.testing.assert_close(fp8.double(), expected, rtol=1e-5, atol=1e-5)
    expected = _reference(q, k16.float(), v16.float(), table, seqs, scale)
    torch.testing.assert_close(bf16.double(), expected, rtol=1e-5, atol=1e-5)
