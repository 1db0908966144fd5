"""bf16 linears on CPUs with bf16 math (AVX512-BF16, AMX): one oneDNN-prepacked weight for every row count.

Without this, a bf16 model's linears go through `F.linear`, torch's generic bf16 GEMM, which neither
keeps the weight in oneDNN's blocked layout nor (on Sapphire Rapids) reaches the AMX tiles: a profile
of batch-1 decode there put ~72% of CPU time in `aten::mm` (issue 11).

The weight is reordered once at load into the layout oneDNN's inner-product primitive wants
(`mkldnn._reorder_linear_weight`, the op torch inductor's `mkldnn_fusion` pass uses for bf16 linears),
and each call is `mkldnn._linear_pointwise` on it, which dispatches to AMX (`brgemm` with tiles) where
the CPU has it and to AVX512-BF16 dot products otherwise. No batch-size hint is given, so one packed
weight serves decode (1 row) and prefill (thousands of rows) alike.

oneDNN refuses bf16 on CPUs without avx512bw/vl/dq or avx_ne_convert (plain AVX2), so there this path
does not exist and `prepare_bf16_linear_weights` returns None; `hearth.ops.cpu_capability` keeps bf16
checkpoints in float32 on such CPUs anyway.
"""

from __future__ import annotations

import torch

from hearth.ops.cpu_capability import cpu_capability


def bf16_prepack_selected(weight: torch.Tensor) -> bool:
    """Whether this weight takes the prepacked bf16 path: a bf16 CPU weight on a CPU with bf16 math."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and cpu_capability().fast_path.has_bf16_math
    )


def reorder_bf16_weight(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked copy of a bf16 `[out, in]` weight (raises RuntimeError where oneDNN has no bf16)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def prepack_bf16_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The prepacked bf16 weight, or None where this weight or CPU does not take the path."""
    if not bf16_prepack_selected(weight) or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return None
    try:
        return reorder_bf16_weight(weight)
    except RuntimeError:  # this oneDNN will not run bf16 here after all (cpuinfo said it could)
        return None


def bf16_packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`x @ W^T + b` for bf16 `x` of any row count against a weight from `prepack_bf16_weight`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
