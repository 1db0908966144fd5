"""INT8 weights with a scale per group (`hearth.ops.int8`, GGUF's Q8_0): the compiled kernel against float64
over the dequantized weights, and the paths it leaves to the dequantized GEMM."""

from __future__ import annotations

import pytest
import torch

from hearth.ops import cpu_kernels
from hearth.ops.int8 import Int8Weights, dequantize_int8, int8_linear


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
