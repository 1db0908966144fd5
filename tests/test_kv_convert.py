"""Page conversion between pools of different KV dtypes (the receiver's side of a PD transfer)."""

from __future__ import annotations

import pytest
import torch

from hearth.kv.convert import convert_pages, pool_scales, write_converted_pages
from hearth.kv.pool import KVLayout, KVPool
from hearth.ops.fp8 import FP8_DTYPE, fake_quantize_fp8

LAYERS, HEADS, DIM, PAGE = 2, 2, 8, 4


def pool(dtype: torch.dtype, scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> KVPool:
    p = KVPool(KVLayout(LAYERS, HEADS, DIM, PAGE, dtype), 8)
    if scales is not None:
        p.set_scales(*scales)
    return p


def filled(p: KVPool, magnitudes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Store random K/V (per-head magnitudes) in every slot of every layer; returns what was stored (float)."""
    torch.manual_seed(0)
    slots = torch.arange(8 * PAGE)
    ks, vs = [], []
    for layer in range(LAYERS):
        k = torch.randn(8 * PAGE, HEADS, DIM) * magnitudes.view(-1, 1)
        v = torch.randn(8 * PAGE, HEADS, DIM) * magnitudes.view(-1, 1)
        p.store(layer, slots, k, v)
        ks.append(k)
        vs.append(v)
    return torch.stack(ks), torch.stack(vs)


def dequantized(p: KVPool, page_ids: list[int]) -> torch.Tensor:
    pages = p.read_pages(page_ids).float()
    if p.quantized:
        scales = torch.stack([p.k_scales, p.v_scales], dim=1)[:, :, None, None, :, None]
        pages = pages * scales
    return pages


def test_bf16_pages_into_an_fp8_pool_use_the_receivers_scales():
    magnitudes = torch.tensor([100.0, 0.05])
    sender = pool(torch.bfloat16)
    k, v = filled(sender, magnitudes)
    k_scales = torch.tensor([[1.2, 0.0003], [1.3, 0.0004]])
    v_scales = torch.tensor([[1.4, 0.0005], [1.5, 0.0006]])
    receiver = pool(FP8_DTYPE, (k_scales, v_scales))
    write_converted_pages(receiver, [6, 1], sender.read_pages([2, 5]), pool_scales(sender))
    got = dequantized(receiver, [6, 1])
    sent = sender.read_pages([2, 5]).float()
    expected = torch.stack(
        [
            torch.stack(
                [
                    fake_quantize_fp8(sent[layer, 0].reshape(-1, HEADS, DIM), k_scales[layer]),
                    fake_quantize_fp8(sent[layer, 1].reshape(-1, HEADS, DIM), v_scales[layer]),
                ]
            )
            for layer in range(LAYERS)
        ]
    ).view_as(got)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # Within FP8's precision of what was sent (ignoring the sender's scales would be off by orders of magnitude).
    torch.testing.assert_close(got, sent, rtol=0.07, atol=1e-3)


def test_fp8_pages_back_to_bf16_and_to_an_fp8_pool_with_other_scales():
    ones = torch.ones(LAYERS, HEADS)
    sender = pool(FP8_DTYPE, (ones * 0.2, ones * 0.3))
    filled(sender, torch.tensor([20.0, 30.0]))
    original = dequantized(sender, [0, 3])
    bf16 = pool(torch.bfloat16)
    write_converted_pages(bf16, [0, 1], sender.read_pages([0, 3]), pool_scales(sender))
    torch.testing.assert_close(bf16.read_pages([0, 1]).float(), original, rtol=0.01, atol=0)
    other = pool(FP8_DTYPE, (ones * 0.25, ones * 0.35))  # room for everything the sender holds
    write_converted_pages(other, [4, 5], sender.read_pages([0, 3]), pool_scales(sender))
    torch.testing.assert_close(dequantized(other, [4, 5]), original, rtol=0.13, atol=0.3)
    same = pool(FP8_DTYPE, (ones * 0.2, ones * 0.3))
    write_converted_pages(same, [7, 2], sender.read_pages([0, 3]), pool_scales(sender))
    assert torch.equal(same.read_pages([7, 2]).view(torch.uint8), sender.read_pages([0, 3]).view(torch.uint8))


def test_scales_are_demanded_where_needed():
    pages = torch.zeros(LAYERS, 2, 1, PAGE, HEADS, DIM, dtype=FP8_DTYPE)
    with pytest.raises(ValueError, match="src_scales"):
        convert_pages(pages, torch.bfloat16)
    with pytest.raises(ValueError, match="dst_scales"):
        convert_pages(pages.float(), FP8_DTYPE)
    with pytest.raises(ValueError, match="convert_pages"):
        pool(FP8_DTYPE, (torch.ones(LAYERS, HEADS), torch.ones(LAYERS, HEADS))).write_pages(
            [0], pages.float()
        )
