"""Which dtype to compute in on this machine."""

from __future__ import annotations

import logging

import torch

from hearth.ops.cpu_capability import cpu_capability

logger = logging.getLogger(__name__)

_NAMED = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def cpu_has_native_half_math() -> bool:
    """bf16/fp16 matmuls on a CPU without AVX512-BF16/AMX/FP16 units are emulated and many times slower."""
    cap = cpu_capability()
    return cap.fast_path.has_bf16_math or "avx512_fp16" in cap.flags


def resolve_dtype(requested: str, checkpoint_dtype: str) -> torch.dtype:
    """`auto` takes the checkpoint's dtype, except that on a CPU without native half math it computes in float32."""
    if requested != "auto":
        return _NAMED[requested]
    dtype = _NAMED.get(checkpoint_dtype.removeprefix("torch."), torch.float32)
    if dtype != torch.float32 and not torch.cuda.is_available() and not cpu_has_native_half_math():
        logger.info("dtype auto: this CPU has no native %s math; computing in float32", checkpoint_dtype)
        return torch.float32
    return dtype
