"""FP8 e4m3 KV storage: per (layer, KV head) scales, quantize on write, dequantize on read.

This CPU has no FP8 math, so FP8 is a storage format only: keys and values are divided by their head's
scale, saturated to the format's range (+-448; past it `.to(float8_e4m3fn)` would give NaN) and rounded to
nearest; readers multiply back. A scale is always a measured one (checkpoint `k_scale`/`v_scale` or a
calibration pass, `hearth.engine.fp8_kv_scales`): a silent 1.0 clips or flushes whatever does not fit.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_DTYPE


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x [tokens, kv_heads, head_dim]` over `scale [kv_heads]` (float32), saturated, as float8_e4m3fn."""
    scaled = x.float() / scale.view(-1, 1)
    return scaled.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x [..., kv_heads, head_dim]` float8 (or any float) times `scale [kv_heads]`, in `dtype`."""
    return (x.to(torch.float32) * scale.view(-1, 1)).to(dtype)


def fake_quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What a store-then-read round trip gives back, in `x`'s dtype: the tests' reference."""
    return dequantize_fp8(quantize_fp8(x, scale), scale, x.dtype)


def scales_from_amax(amax: torch.Tensor, headroom: float = 1.5) -> torch.Tensor:
    """Scales that map `amax * headroom` to the format's largest value (headroom for activations past the
    calibration text's); never zero, so a head that was silent in calibration still round-trips."""
    return (amax.float() * headroom / FP8_MAX).clamp_(min=1e-6)
