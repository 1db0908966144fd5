"""Row counts padded to a few bucket sizes, so per-shape kernel state is bounded (issue 19).

oneDNN (through torch's `mkldnn._linear_pointwise`) builds and caches a primitive, with its JIT code and
scratch buffers, for every distinct input shape, and a serving step's row count is its token count: every
new prefill-chunk length is a new shape. Measured on AMD EPYC (AVX2, float32 compute) with the demo
model's five weight shapes: ~0.55 MB per (row count, weight shape), so a soak whose steps see row counts
1..2048 grew the engine core's RSS by +74% and kept growing long after warm-up.

Padding the rows to `bucket_rows(rows)` bounds that state to a fixed set of shapes: exact up to
`EXACT_MAX_ROWS` (decode batches, and the bf16 skinny kernel serves most of those anyway), then
`STEPS_PER_OCTAVE` sizes per power of two, so a padded matmul does at most 1/STEPS_PER_OCTAVE more
rows (12.5% at 8 per octave, 6% on average) and rows 1..2048 map to 72 shapes instead of 2048.

Padding happens inside one linear call and only for its input rows: the padding rows are zeros, their
outputs are sliced off before anything else sees them, and no KV page is ever read or written for them.
"""

from __future__ import annotations

import os

import torch

# HEARTH_ROW_BUCKETS=0 turns the padding off (A/B measurements; `docs/benchmarks.md`, issue 19 soak).
ENABLED = os.environ.get("HEARTH_ROW_BUCKETS", "1") != "0"
EXACT_MAX_ROWS = 16
# 8: a 400-token prompt's matmuls pad to 416 rows, not 448 (at 4 per octave, 7% of its prefill's GEMM time).
STEPS_PER_OCTAVE = 8


def bucket_rows(rows: int) -> int:
    """The bucket size `rows` is padded to: itself up to EXACT_MAX_ROWS, then the next multiple of
    2**floor(log2 rows) / STEPS_PER_OCTAVE (so 17 -> 18, 100 -> 104, 1000 -> 1024, 1025 -> 1152)."""
    if rows <= EXACT_MAX_ROWS:
        return rows
    granule = (1 << (rows.bit_length() - 1)) // STEPS_PER_OCTAVE
    return -(-rows // granule) * granule


def padded_linear_pointwise(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`torch.ops.mkldnn._linear_pointwise(x, packed, bias)` with x's rows padded to their bucket (zero rows,
    whose outputs are dropped), so oneDNN builds one primitive per bucket, not one per row count."""
    rows = x.shape[0]
    padded_rows = bucket_rows(rows) if ENABLED else rows
    if padded_rows != rows:
        padded = x.new_empty((padded_rows, *x.shape[1:]))
        padded[:rows].copy_(x)
        padded[rows:].zero_()  # uninitialized memory could hold NaN/inf bit patterns: slow paths, FP traps
        x = padded
    out = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return out[:rows] if padded_rows != rows else out
