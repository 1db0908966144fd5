"""INT8 weights with a scale per group (`hearth.ops.int8`, GGUF's Q8_0): the compiled kernel against float64
over the dequantized weights, and the paths it leaves to the dequantized GEMM."""

from __future__ import annotations

import pytest
import torch

from hearth.ops import cpu_kernels
from hearth.ops.int8 import INT8_ACTIVATION_MAX_ROWS, Int8Weights, dequantize_int8, int8_linear


def random_int8(out: int, k: int, group: int) -> Int8Weights:
    q = torch.randint(-127, 128, (out, k), dtype=torch.int8)
    scales = torch.rand(out, k // group) * 0.02 + 1e-3
    return Int8Weights(q, scales, group)


@pytest.fixture(scope="module")
def kernel():
    cpu_kernels.paged_decode_attention_kernel(wait=True)
    built = cpu_kernels.int8_skinny_linear_kernel()
    assert built is not None, "the INT8 kernel did not build"
    return built


@pytest.mark.parametrize("group", [32, 64])
def test_int8_kernel_matches_float64_over_dequantized_weights(kernel, group):
    out, k = 103, 320  # 103 outputs: tiles of 4 and 2 output rows leave a tail; 320: 10 groups of 32, 5 of 64
    weights = random_int8(out, k, group)
    dense = weights.q.double().view(out, k // group, group) * weights.scales.double()[:, :, None]
    torch.testing.assert_close(dequantize_int8(weights).double(), dense.view(out, k))
    bias = torch.randn(out)
    for rows in (1, 2, 3, 4, 5, 7, 16, 33, 64, 130):
        x = torch.randn(rows, k)
        exact = x.double() @ dense.view(out, k).t() + bias.double()
        torch.testing.assert_close(int8_linear(x, weights, bias).double(), exact, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(
            kernel(x, weights.q, weights.scales, group).double(), exact - bias.double(), rtol=1e-5, atol=1e-5
        )


def test_int8_kernel_reads_strided_rows(kernel):
    weights = random_int8(40, 128, 32)
    wide = torch.randn(3, 256)
    x = wide[:, :128]  # unit inner stride, row stride 256
    exact = x.double() @ dequantize_int8(weights).double().t()
    torch.testing.assert_close(kernel(x, weights.q, weights.scales, 32).double(), exact, rtol=1e-5, atol=1e-5)


def test_without_the_kernel_the_weight_is_dequantized_and_exact(monkeypatch):
    monkeypatch.setattr("hearth.ops.int8.int8_skinny_linear_kernel", lambda: None)
    weights = random_int8(24, 64, 32)
    x = torch.randn(9, 64)
    torch.testing.assert_close(
        int8_linear(x, weights, None).double(),
        x.double() @ dequantize_int8(weights).double().t(),
        rtol=1e-5,
        atol=1e-5,
    )


def test_int8_kernel_refuses_bad_inputs(kernel):
    weights = random_int8(8, 64, 32)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="int8"):
        kernel(x, weights.q.float(), weights.scales, 32)  # not int8
    with pytest.raises(RuntimeError, match="group size"):
        kernel(x, weights.q, weights.scales, 24)  # not a multiple of 16
    with pytest.raises(RuntimeError, match="scales"):
        kernel(x, weights.q, weights.scales[:, :1].contiguous(), 32)
    with pytest.raises(RuntimeError, match="x must be"):
        kernel(x.double(), weights.q, weights.scales, 32)


def _rounded_like_the_kernel(x: torch.Tensor, group: int) -> torch.Tensor:
    """x rounded to int8 per (row, group) as the W8A8 kernel rounds it, back in float64."""
    grouped = x.view(x.shape[0], -1, group)
    amax = grouped.abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    quantized = torch.round(grouped * inverse).clamp(-127, 127)
    return (quantized.double() * (amax / 127).double()).view(x.shape)


@pytest.mark.parametrize("group", [32, 64])
def test_w8a8_rounds_decode_rows_only_and_matches_the_rounded_product(kernel, group):
    if "avx512_vnni" not in open("/proc/cpuinfo").read():
        pytest.skip("W8A8 runs on AVX-512 VNNI only (float activations elsewhere)")
    out, k = 70, 320 if group == 32 else 384
    weights = random_int8(out, k, group)
    weights.int8_activations = True
    weights.q[0, :5] = -128  # the format allows it; the sign-bit flip must still give its products
    dense = dequantize_int8(weights).double()
    bias = torch.randn(out)
    for rows in (1, 3, 4, 7, INT8_ACTIVATION_MAX_ROWS):
        x = torch.randn(rows, k)
        got = int8_linear(x, weights, bias).double()
        rounded = _rounded_like_the_kernel(x, group) @ dense.t() + bias.double()
        torch.testing.assert_close(got, rounded, rtol=1e-4, atol=1e-4)
        assert (got - (x.double() @ dense.t() + bias.double())).abs().max() > 1e-4  # really rounded
    x = torch.randn(INT8_ACTIVATION_MAX_ROWS + 1, k)  # prefill rows: float activations
    torch.testing.assert_close(
        int8_linear(x, weights, bias).double(), x.double() @ dense.t() + bias.double(), rtol=1e-5, atol=1e-5
    )
