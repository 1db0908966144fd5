"""INT4 weight-only matmul on CPU: the packed layout, dequantization, and the per-call choice of path.

A weight `[out, in]` is `w[o, i] = (q[o, i] - zero[o, g]) * scale[o, g]` with `q` in 0..15 and `g = i //
group_size`. Act-order checkpoints (GPTQ `desc_act`, a `g_idx` per input column) are handled by sorting the
input columns by group once at load: `perm` reorders the activations' features to match.

- Every row count of float32 CPU activations runs on the compiled `int4_skinny_linear` kernel, which reads the
  packed nibbles (~3.5x fewer bytes than bf16) and unpacks each block of weights once for a pass of up to 8
  rows (~310 GFLOP/s on 2 AVX-512 cores at 256-2,048 rows, docs/benchmarks.md session 9). Dequantizing the weight for a float GEMM per call
  took 2.4-20x the kernel's time at 16 rows and 0.9-6.9x at 64-256 (`scripts/bench_int4_linear.py
  --group-size 32`, SmolLM2's shapes): the unpack, not the product, dominated it. A checkpoint that ships INT4 (GPTQ,
  AWQ, compressed-tensors, GGUF) runs with its own numerics by default: float32 activations (W4A16, as vLLM's
  Marlin path), so its tokens are the dequantized reference's. `--quantization int4` (Hearth's own RTN
  rounding, no reference to match) rounds the activations to int8 per (row, group) and takes an integer dot
  by default (W4A8, as llama.cpp's Q4 x Q8) for up to `INT4_MAX_ROWS` rows (decode), float activations above
  (prefill, where the arithmetic, not the bytes, bounds it). `HEARTH_INT4_ACTIVATIONS=int8|float` sets it for
  every INT4 layer (W4A8 on a checkpoint is an explicit opt-in; docs/quantization.md has its cost).
- Prompt chunks under bf16 prefill math (`hearth.ops.prefill_math`, the default for checkpoint INT4 on CPUs with
  bf16 math): the weight is dequantized to bf16 in one pass (`int4_dequantize_bf16`) and multiplied by oneDNN's
  bf16 GEMM, 2.6-2.8x the float32 kernel at 256-1,500 rows on 2 Zen 5 cores.
- No kernel (not built yet, another device or dtype): the weight is dequantized for the call and multiplied.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from hearth.ops.cpu_kernels import int4_dequantize_bf16_kernel, int4_skinny_linear_kernel
from hearth.ops.prefill_math import bf16_tile_linear, bf16_tiles

INT4_MAX_ROWS = 16  # W4A8 (int8 activations) up to this many rows; float activations above
BLOCK = 64  # weights per packed block (the kernel's unit)


def int8_activations_default(checkpoint_format: bool = False) -> bool:
    """W4A8 for Hearth's own RTN weights, W4A16 for a checkpoint's INT4 (`checkpoint_format`), unless
    `HEARTH_INT4_ACTIVATIONS=int8|float` says otherwise (read when a layer's weights are built)."""
    value = os.environ.get("HEARTH_INT4_ACTIVATIONS", "")
    if value not in ("", "int8", "float"):
        raise ValueError(f"HEARTH_INT4_ACTIVATIONS={value!r}: expected 'int8' or 'float'")
    return value == "int8" if value else not checkpoint_format


@dataclass
class Int4Weights:
    packed: torch.Tensor  # uint8 [out, in / 2], `pack_int4`'s layout
    scales: torch.Tensor  # float32 [out, groups]
    zero_scaled: torch.Tensor  # float32 [out, groups]: zero point x scale
    group_size: int
    perm: torch.Tensor | None = None  # long [in]: activation features in packed column order (act-order)
    kernel_ok: bool = True  # the layout the kernel reads (else: dequantize per call)
    int8_activations: bool = field(default_factory=int8_activations_default)  # W4A8 in the kernel

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales, self.zero_scaled))


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """`q` uint8 `[out, in]` (values 0..15, `in` a multiple of 64) -> uint8 `[out, in / 2]`: per block of 64
    weights, 32 bytes whose byte b holds weight b (low nibble) and weight b + 32 (high nibble): the kernel
    unpacks 32 consecutive weights with one AND (and a shift), no byte shuffles."""
    out, k = q.shape
    if k % BLOCK:
        raise ValueError(f"pack_int4: {k} input features is not a multiple of {BLOCK}")
    halves = q.view(out, k // BLOCK, 2, BLOCK // 2)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).contiguous().view(out, k // 2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    out, half = packed.shape
    blocks = packed.contiguous().view(out, half // 32, 32)
    return torch.stack((blocks & 0x0F, blocks >> 4), dim=2).reshape(out, half * 2)


def make_int4_weights(
    q: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    g_idx: torch.Tensor | None = None,
    *,
    checkpoint_format: bool = False,
) -> Int4Weights:
    """From unpacked `q [out, in]` (0..15), `scales`/`zeros [out, groups]` (zeros in q units) and, for
    act-order, `g_idx [in]` (each column's group). `checkpoint_format`: the weights are a checkpoint's own
    INT4 (W4A16 by default), not Hearth's RTN rounding."""
    perm = None
    if g_idx is not None:
        g_idx = g_idx.long()
        trivial = torch.arange(q.shape[1]) // group_size
        if not torch.equal(g_idx, trivial):
            perm = torch.argsort(g_idx, stable=True)
            counts = torch.bincount(g_idx, minlength=scales.shape[1])
            if not bool((counts == group_size).all()):
                raise ValueError("g_idx: every group must hold exactly group_size columns")
            q = q[:, perm]
    scales = scales.float().contiguous()
    return Int4Weights(
        packed=pack_int4(q),
        scales=scales,
        zero_scaled=(zeros.float() * scales).contiguous(),
        group_size=group_size,
        perm=perm,
        int8_activations=int8_activations_default(checkpoint_format),
    )


def dequantize_int4(weights: Int4Weights) -> torch.Tensor:
    """float32 `[out, in]` in the checkpoint's column order."""
    q = unpack_int4(weights.packed).float()
    out, k = q.shape
    grouped = q.view(out, k // weights.group_size, weights.group_size)
    dense = (grouped * weights.scales[:, :, None] - weights.zero_scaled[:, :, None]).view(out, k)
    if weights.perm is not None:
        restored = torch.empty_like(dense)
        restored[:, weights.perm] = dense
        return restored
    return dense


def int4_linear(x: torch.Tensor, weights: Int4Weights, bias: torch.Tensor | None) -> torch.Tensor:
    if (
        bf16_tiles(x)
        and weights.kernel_ok
        and weights.group_size % 16 == 0
        and (dequantize := int4_dequantize_bf16_kernel()) is not None
    ):
        xs = x if weights.perm is None else x.index_select(1, weights.perm)
        dense = dequantize(weights.packed, weights.scales, weights.zero_scaled, weights.group_size)
        return bf16_tile_linear(xs, dense, bias)
    if x.dtype == torch.float32 and x.device.type == "cpu" and weights.kernel_ok:
        kernel = int4_skinny_linear_kernel()
        if kernel is not None:
            xs = x if weights.perm is None else x.index_select(1, weights.perm)
            return kernel(
                xs.contiguous(),
                weights.packed,
                weights.scales,
                weights.zero_scaled,
                weights.group_size,
                bias,
                weights.int8_activations and x.shape[0] <= INT4_MAX_ROWS,
            )
    return F.linear(x, dequantize_int4(weights).to(x.dtype), bias)


def quantize_rtn(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest asymmetric 4-bit quantization per group: (q uint8 [out, in], scales, zeros [out, groups])."""
    out, k = weight.shape
    grouped = weight.float().view(out, k // group_size, group_size)
    low = grouped.amin(dim=-1).clamp(max=0)
    high = grouped.amax(dim=-1).clamp(min=0)
    scales = ((high - low) / 15).clamp(min=1e-8)
    zeros = torch.round(-low / scales).clamp(0, 15)
    q = torch.round(grouped / scales[..., None] + zeros[..., None]).clamp(0, 15).to(torch.uint8)
    return q.view(out, k), scales, zeros
