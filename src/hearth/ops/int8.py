"""INT8 weights with a scale per group of input features (GGUF's Q8_0: `w = d * q`, 32 weights per scale).

No compiled kernel yet: each call dequantizes the weight to the activations' dtype and multiplies (the
products are the format's own, so the result is the dequantized reference's). What it saves over a dense
layer is memory: 1 byte a weight plus a scale per group, instead of 4 (float32) or 2 (bf16).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Int8Weights:
    q: torch.Tensor  # int8 [out, in]
    scales: torch.Tensor  # float32 [out, in / group_size]
    group_size: int

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scales.numel() * self.scales.element_size()


def dequantize_int8(weights: Int8Weights) -> torch.Tensor:
    """float32 `[out, in]`."""
    out, k = weights.q.shape
    grouped = weights.q.view(out, k // weights.group_size, weights.group_size).float()
    return (grouped * weights.scales[:, :, None]).view(out, k)


def int8_linear(x: torch.Tensor, weights: Int8Weights, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, dequantize_int8(weights).to(x.dtype), bias)
