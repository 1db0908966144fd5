"""The math of prompt rows on CPU: float32 activations multiplied as float32, or on bf16 tiles.

Float32 activations (a quantized checkpoint's own numerics: GGUF, GPTQ/AWQ INT4, Q8_0; or a float32 model) run
their matmuls at the float32 FMA rate. On CPUs with bf16 math that is a fraction of the bf16 dot-product rate
(2 Zen 5 cores: oneDNN float32 GEMM ~200 GFLOP/s, bf16 ~950; Sapphire Rapids' AMX tiles more), and a prompt chunk
is all arithmetic. With `bfloat16`, the matmuls of at least `BF16_MIN_ROWS` rows (prompt chunks, large batches)
and prompt-chunk attention round their inputs to bf16 and accumulate in float32, as vLLM-CPU and SGLang run every
row: an INT4/INT8 weight is dequantized to bf16 for the call (`csrc/dequantize_bf16.cpp`, ~1-2% of the GEMM) and
multiplied by oneDNN; attention takes the bf16 tiles (`csrc/prefill_attention.cpp`). Norms, the residual stream,
RoPE, the KV pool and every step of fewer rows (decode, with the fused decode stack) keep float32.

`auto` picks `bfloat16` for quantized weights on CPUs with bf16 math, where the file's own numerics are not
float32 anyway and the gain is 2-3x a prefill; float32 checkpoints served in float32 keep their exact numerics.
The measured cost (greedy agreement, perplexity against transformers) is in docs/quantization.md.

A worker resolves the engine option once, at load, and runs each forward in `prefill_math_scope(resolved)`: the
choice holds for that forward's call stack only (a context variable), so two models in one process (tests, an
in-process `LLM` beside a served one) never see each other's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F

from hearth.ops.cpu_capability import cpu_capability

# Fewer rows (decode batches) keep float32 and the INT4/INT8 kernels, which read ~4x fewer weight bytes; at 64
# rows the bf16 GEMM already takes ~0.75x the INT4 kernel's time on SmolLM2's shapes (docs/benchmarks.md).
BF16_MIN_ROWS = 64

_bf16_prompt_rows: ContextVar[bool] = ContextVar("hearth_bf16_prompt_rows", default=False)


def resolve_prefill_math(
    choice: str, *, quantized: bool, activations: torch.dtype, device: torch.device
) -> str:
    """`float32` or `bfloat16` for the engine option `choice` (`auto`, `float32` or `bfloat16`, checked by the
    config; see the module docstring for `auto`); bfloat16 only where it applies (float32 activations on a CPU with
    bf16 math), else float32."""
    applies = (
        device.type == "cpu" and activations == torch.float32 and cpu_capability().fast_path.has_bf16_math
    )
    if choice == "auto":
        return "bfloat16" if applies and quantized else "float32"
    return "bfloat16" if choice == "bfloat16" and applies else "float32"


@contextmanager
def prefill_math_scope(resolved: str) -> Iterator[None]:
    """Inside: prompt rows take `resolved`'s math (`resolve_prefill_math`'s answer)."""
    token = _bf16_prompt_rows.set(resolved == "bfloat16")
    try:
        yield
    finally:
        _bf16_prompt_rows.reset(token)


def bf16_rows(x: torch.Tensor) -> bool:
    """Whether this float32 CPU operand of `x.shape[0]` rows takes the bf16 tiles."""
    return _bf16_prompt_rows.get() and x.dtype == torch.float32 and x.shape[0] >= BF16_MIN_ROWS


def bf16_tiles(x: torch.Tensor) -> bool:
    """Whether a quantized linear takes the bf16 tiles for `x`: a float32 operand as `bf16_rows` says, or one a
    caller already rounded to bf16 inside the scope (an MLP's intermediate, kept in bf16 between its GEMMs)."""
    if x.dtype == torch.bfloat16:
        return _bf16_prompt_rows.get() and x.shape[0] >= BF16_MIN_ROWS
    return bf16_rows(x)


def bf16_tile_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`x @ weight^T + bias` with `x` rounded to bf16 and a bf16 `weight`, accumulated in float32 by oneDNN (a
    plain weight: its reorder is part of the call, cheaper than keeping a blocked bf16 copy), in `x`'s dtype."""
    if x.dtype == torch.bfloat16:
        return F.linear(x, weight, None if bias is None else bias.to(torch.bfloat16))
    out = F.linear(x.to(torch.bfloat16), weight).float()
    return out if bias is None else out.add_(bias)
