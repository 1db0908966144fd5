"""INT8 weights with a scale per group of input features (GGUF's Q8_0: `w = d * q`, 32 weights per scale).

float32 rows on CPU run on the compiled `int8_skinny_linear` kernel, which widens the int8 weights in
registers and multiplies them with the float activations (the file's weights exactly, a quarter of float32's
bytes read; blocks of outputs stay in cache across passes of rows, so many rows cost arithmetic, not bytes).
With `int8_activations` (the `HEARTH_INT4_ACTIVATIONS=int8` opt-in, as llama.cpp's Q8_0 x Q8_0) up to
`INT8_ACTIVATION_MAX_ROWS` rows are rounded to int8 per (row, group) and multiplied as integers (AVX-512 VNNI;
float activations on CPUs without it, and for more rows).
Prompt chunks under bf16 prefill math (`hearth.ops.prefill_math`) dequantize the weight to bf16 for oneDNN's GEMM.
Otherwise (no kernel, another device or dtype) each call dequantizes the weight to the activations' dtype and
multiplies: the products are the format's own either way, so the result is the dequantized reference's up to
summation order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hearth.ops.cpu_kernels import int8_dequantize_bf16_kernel, int8_skinny_linear_kernel
from hearth.ops.prefill_math import bf16_tile_linear, bf16_tiles

INT8_ACTIVATION_MAX_ROWS = 16  # as INT4's W4A8: decode rows; prefill keeps float activations


@dataclass
class Int8Weights:
    q: torch.Tensor  # int8 [out, in]
    scales: torch.Tensor  # float32 [out, in / group_size]
    group_size: int
    int8_activations: bool = False  # W8A8 in the kernel (decode rows)

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scales.numel() * self.scales.element_size()


def dequantize_int8(weights: Int8Weights) -> torch.Tensor:
    """float32 `[out, in]`."""
    out, k = weights.q.shape
    grouped = weights.q.view(out, k // weights.group_size, weights.group_size).float()
    return (grouped * weights.scales[:, :, None]).view(out, k)


def int8_linear(x: torch.Tensor, weights: Int8Weights, bias: torch.Tensor | None) -> torch.Tensor:
    if bf16_tiles(x) and weights.group_size % 16 == 0 and (dequantize := int8_dequantize_bf16_kernel()):
        return bf16_tile_linear(x, dequantize(weights.q, weights.scales, weights.group_size), bias)
    if (
        x.dtype == torch.float32
        and x.device.type == "cpu"
        and weights.group_size % 16 == 0
        and (kernel := int8_skinny_linear_kernel()) is not None
    ):
        a8 = weights.int8_activations and x.shape[0] <= INT8_ACTIVATION_MAX_ROWS
        return kernel(x.contiguous(), weights.q, weights.scales, weights.group_size, bias, a8)  # type: ignore[return-value]
    return F.linear(x, dequantize_int8(weights).to(x.dtype), bias)
