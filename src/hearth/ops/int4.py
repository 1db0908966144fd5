"""INT4 weight-only matmul on CPU: the packed layout, dequantization, and the per-call choice of path.

A weight `[out, in]` is `w[o, i] = (q[o, i] - zero[o, g]) * scale[o, g]` with `q` in 0..15 and `g = i //
group_size`. Act-order checkpoints (GPTQ `desc_act`, a `g_idx` per input column) are handled by sorting the
input columns by group once at load: `perm` reorders the activations' features to match.

- Up to `INT4_MAX_ROWS` rows (decode): the compiled `int4_skinny_linear` kernel reads the packed nibbles
  (~3.5x fewer bytes than bf16).
- More rows (prefill) or no kernel: the weight is dequantized to float32 for the call and multiplied by
  oneDNN/MKL; the arithmetic dominates there, and nothing float-sized is kept between calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hearth.ops.cpu_kernels import int4_skinny_linear_kernel

INT4_MAX_ROWS = 16
BLOCK = 64  # weights per packed block (the kernel's unit)


@dataclass
class Int4Weights:
    packed: torch.Tensor  # uint8 [out, in / 2], `pack_int4`'s layout
    scales: torch.Tensor  # float32 [out, groups]
    zero_scaled: torch.Tensor  # float32 [out, groups]: zero point x scale
    group_size: int
    perm: torch.Tensor | None = None  # long [in]: activation features in packed column order (act-order)
    kernel_ok: bool = True  # the layout the kernel reads (else: dequantize per call)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales, self.zero_scaled))


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """`q` uint8 `[out, in]` (values 0..15, `in` a multiple of 64) -> uint8 `[out, in / 2]`: per block of 64
    weights, 8 little-endian uint32 lanes whose nibble j in lane l is weight 8j + l (the kernel's layout)."""
    out, k = q.shape
    if k % BLOCK:
        raise ValueError(f"pack_int4: {k} input features is not a multiple of {BLOCK}")
    nibbles = q.to(torch.int64).view(out, k // BLOCK, 8, 8)  # [.., j, l]
    shifts = (4 * torch.arange(8, dtype=torch.int64)).view(1, 1, 8, 1)
    lanes = (nibbles << shifts).sum(dim=2)  # [out, blocks, 8 lanes]
    lanes = torch.where(lanes >= 2**31, lanes - 2**32, lanes).to(torch.int32)
    return lanes.contiguous().view(torch.uint8).view(out, k // 2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    out, half = packed.shape
    lanes = packed.contiguous().view(torch.int32).view(out, half // 32, 1, 8)
    shifts = (4 * torch.arange(8, dtype=torch.int32)).view(1, 1, 8, 1)
    return ((lanes >> shifts) & 0x0F).to(torch.uint8).reshape(out, half * 2)


def make_int4_weights(
    q: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    g_idx: torch.Tensor | None = None,
) -> Int4Weights:
    """From unpacked `q [out, in]` (0..15), `scales`/`zeros [out, groups]` (zeros in q units) and, for
    act-order, `g_idx [in]` (each column's group)."""
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
    rows = x.shape[0]
    if rows <= INT4_MAX_ROWS and x.dtype == torch.float32 and x.device.type == "cpu" and weights.kernel_ok:
        kernel = int4_skinny_linear_kernel()
        if kernel is not None:
            xs = x if weights.perm is None else x.index_select(1, weights.perm)
            return kernel(
                xs.contiguous(), weights.packed, weights.scales, weights.zero_scaled, weights.group_size, bias
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
