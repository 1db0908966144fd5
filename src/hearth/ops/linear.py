"""Dense matmul fast paths on CPU, chosen per call by the number of rows.

- **bf16 weights, few rows.** Decoding a handful of sequences is bound by reading the weights.
  Checkpoints ship bf16 weights; where we compute in float32 (CPUs without native bf16) the
  float32 copy holds exactly those values, so a bf16 copy loses nothing and halves the bytes a
  step reads. The compiled `bf16_skinny_linear` kernel (`ops/csrc`) multiplies float32 rows by it.
- **oneDNN with a prepacked weight** for 2 to ~256 rows (and for everything when the float32
  weight was dropped): 1.1-1.8x faster than `F.linear` (MKL) on the AVX2 machines we measured.
- **A [in, out] copy** for a one-row product with a large float32-only weight (the LM head of a
  float32 checkpoint): MKL's GEMV over it runs ~2x faster than `F.linear`.

`scripts/bench_lm_head.py` and `scripts/bench_decode_step.py` reproduce the figures.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hearth.ops.cpu_kernels import bf16_skinny_linear_kernel
from hearth.ops.row_buckets import padded_linear_pointwise

PACKED_MIN_ROWS = 2
PACKED_MAX_ROWS = 256
# Up to this many rows the bf16 kernel (passes of 8 rows over half the bytes) beats oneDNN's float32
# path: decode steps 0.53x as long at batch 1-4, 0.63x at 8, 0.86x at 16, 1.06x at 32 (2 threads).
BF16_MAX_ROWS = 16


@dataclass
class LinearWeights:
    """The layouts of one `[out, in]` weight that `linear` picks from; at least one of
    `fp32`/`packed` is set, so every row count has a path while the kernels are still building."""

    fp32: torch.Tensor | None
    packed: torch.Tensor | None = None
    bf16: torch.Tensor | None = None
    transposed: torch.Tensor | None = None  # [in, out], one-row GEMV layout


def prepack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """A oneDNN-reordered copy of a float32 CPU weight `[out, in]`, or None where that path does not exist."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight") or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    except RuntimeError:  # a torch build whose oneDNN lacks the linear primitive
        return None


def exact_bf16_copy(weight: torch.Tensor) -> torch.Tensor | None:
    """A bf16 copy of a float32 CPU weight whose every value is a bf16 value (a bf16 checkpoint), else None."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    copy = weight.detach().to(torch.bfloat16)
    return copy if torch.equal(copy.float(), weight) else None


def prepare_linear_weights(weight: torch.Tensor, gemv_layout: bool = False) -> LinearWeights:
    """Lay out a loaded weight for `linear`. The float32 weight is kept only where nothing replaces
    it (no oneDNN); `gemv_layout` adds the one-row [in, out] copy when no bf16 copy exists."""
    weight = weight.detach()
    packed = prepack_weight(weight)
    bf16 = exact_bf16_copy(weight)
    transposed = (
        weight.t().contiguous() if gemv_layout and bf16 is None and weight.device.type == "cpu" else None
    )
    return LinearWeights(
        fp32=None if packed is not None else weight, packed=packed, bf16=bf16, transposed=transposed
    )


def linear(x: torch.Tensor, weights: LinearWeights, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.shape[0]
    if weights.bf16 is not None and rows <= BF16_MAX_ROWS and x.dtype == torch.float32:
        kernel = bf16_skinny_linear_kernel()
        if kernel is not None:
            return kernel(x.contiguous(), weights.bf16, bias)
    if weights.transposed is not None and rows == 1:
        out = x @ weights.transposed
        return out if bias is None else out + bias
    if weights.packed is not None and (weights.fp32 is None or PACKED_MIN_ROWS <= rows <= PACKED_MAX_ROWS):
        # Rows padded to a few bucket sizes: oneDNN keeps state per input shape (issue 19, `row_buckets`).
        return padded_linear_pointwise(x, weights.packed, bias)
    assert weights.fp32 is not None
    return F.linear(x, weights.fp32, bias)
