"""INT4 weight-only linear layers: the shared part of every INT4 format, and `--quantization int4`
(round-to-nearest per group, at load time, from a BF16/FP32 checkpoint).

A format (GPTQ, AWQ, compressed-tensors) registers its checkpoint tensors in `create_weights` and turns
them into unpacked nibbles, scales and zero points in `unpack`; `process_after_loading` then builds the
kernel's layout (`hearth.ops.int4`) and drops the checkpoint tensors.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hearth.model.config import ModelLoadError
from hearth.model.quantization.registry import QuantizationMethod
from hearth.model.weights import set_weight_attrs
from hearth.ops.int4 import Int4Weights, int4_linear, make_int4_weights, quantize_rtn

if TYPE_CHECKING:
    from hearth.model.layers import Linear

PACK = 8  # INT4 values per int32


def add_param(
    layer: Linear,
    name: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    **attrs: Any,
) -> None:
    """Register a loading-only parameter (`attrs`: output_dim/input_dim and their packing) on `layer`."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    set_weight_attrs(param, weight_loader=attrs.pop("weight_loader", layer.weight_loader), **attrs)
    layer.register_parameter(name, param)


def check_divisible(layer: Linear, input_size: int, output_size: int, group_size: int) -> None:
    if input_size % group_size or input_size % 64 or output_size % PACK or group_size % 32:
        raise ModelLoadError(
            f"INT4: a {output_size}x{input_size} layer does not fit group size {group_size} "
            "(input features must be a multiple of 64 and of the group size, itself a multiple of 32; "
            "outputs of 8)"
        )


def unpack_int32(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """Eight 4-bit values per int32 (value j in bits 4j..4j+3), unpacked along `dim`: uint8 0..15."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    if dim == 0:
        values = (packed[:, None, :] >> shifts[None, :, None]) & 0xF  # [rows/8, 8, cols]
        return values.reshape(-1, packed.shape[1]).to(torch.uint8)
    values = (packed[:, :, None] >> shifts[None, None, :]) & 0xF  # [rows, cols/8, 8]
    return values.reshape(packed.shape[0], -1).to(torch.uint8)


def pack_int32(values: torch.Tensor, dim: int) -> torch.Tensor:
    """The inverse of `unpack_int32` (the tests write checkpoints with it)."""
    v = values.to(torch.int64)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    if dim == 0:
        grouped = v.reshape(-1, PACK, v.shape[1]) << shifts[None, :, None]
        packed = grouped.sum(dim=1)
    else:
        grouped = v.reshape(v.shape[0], -1, PACK) << shifts[None, None, :]
        packed = grouped.sum(dim=2)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # the same 32 bits, signed


class Int4LinearMethod(QuantizationMethod):
    """Applies `layer.int4` (`Int4Weights`); subclasses say how the checkpoint stores it."""

    group_size: int = 128

    @abstractmethod
    def unpack(self, layer: Linear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(q uint8 [out, in] 0..15, scales [out, groups], zeros [out, groups] in q units, g_idx [in] or None)."""

    @abstractmethod
    def checkpoint_params(self) -> tuple[str, ...]:
        """The loading-only parameters `process_after_loading` drops."""

    def process_after_loading(self, layer: Linear) -> None:
        q, scales, zeros, g_idx = self.unpack(layer)
        part_orders: dict[Any, torch.Tensor] = getattr(layer, "_g_idx_parts", {})
        if g_idx is not None and len({tuple(order.tolist()) for order in part_orders.values()}) > 1:
            # Act-order parts of a fused layer (q/k/v, gate/up quantized one by one) with different column
            # orders: each part keeps its own packed order and activation permutation (kept unfused).
            layer.int4_parts = [
                make_int4_weights(
                    q[shard.local_offset : shard.local_offset + shard.size],
                    scales[shard.local_offset : shard.local_offset + shard.size],
                    zeros[shard.local_offset : shard.local_offset + shard.size],
                    self.group_size,
                    part_orders[shard_id],
                    checkpoint_format=True,
                )
                for shard_id, shard in layer.output_shards.items()
            ]
        else:
            layer.int4 = make_int4_weights(q, scales, zeros, self.group_size, g_idx, checkpoint_format=True)
        for name in self.checkpoint_params():
            delattr(layer, name)

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        parts: list[Int4Weights] | None = getattr(layer, "int4_parts", None)
        if parts is not None:
            out = torch.cat([int4_linear(x, weights, None) for weights in parts], dim=-1)
            return out if bias is None else out + bias
        weights: Int4Weights = layer.int4
        return int4_linear(x, weights, bias)


def load_g_idx(layer: Linear, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
    """Each part's `g_idx` (its columns' groups: the act-order). The parts of a fused layer (q/k/v,
    gate/up) share their input, and usually their order; where a checkpoint quantized them one by one
    with different orders, `process_after_loading` keeps the parts apart (`int4_parts`)."""
    if tuple(loaded.shape) != tuple(param.shape):
        raise ModelLoadError(f"g_idx has shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")
    loaded = loaded.to(param.dtype)
    param.data.copy_(loaded)
    if not hasattr(layer, "_g_idx_parts"):
        layer._g_idx_parts = {}
    layer._g_idx_parts[shard_id] = loaded.clone()


def rtn_group_size(input_features: int) -> int:
    """128 input features per RTN group, 64 where 128 does not divide them; a ModelLoadError otherwise."""
    group_size = next((g for g in (128, 64) if input_features % g == 0), None)
    if group_size is None:
        raise ModelLoadError(f"--quantization int4: {input_features} input features is not a multiple of 64")
    return group_size


class RTNInt4Method(Int4LinearMethod):
    """`--quantization int4`: the checkpoint's dense weights, rounded to nearest per group of 128 input
    features (64 where 128 does not divide them), asymmetric (a zero point per group)."""

    def create_weights(
        self, layer: Linear, input_size: int, output_size: int, params_dtype: torch.dtype
    ) -> None:
        add_param(layer, "weight", (output_size, input_size), params_dtype, output_dim=0, input_dim=1)

    def checkpoint_params(self) -> tuple[str, ...]:
        return ("weight",)

    def unpack(self, layer: Linear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        weight = layer.weight.data
        group_size = rtn_group_size(weight.shape[1])
        q, scales, zeros = quantize_rtn(weight, group_size)
        layer.int4_group_size = group_size
        return q, scales, zeros, None

    def process_after_loading(self, layer: Linear) -> None:
        q, scales, zeros, _ = self.unpack(layer)
        layer.int4 = make_int4_weights(q, scales, zeros, layer.int4_group_size)
        del layer.weight

    def quantize_lm_head(self, weight: torch.Tensor) -> Int4Weights | None:
        return rtn_lm_head(weight)


def rtn_lm_head(weight: torch.Tensor) -> Int4Weights | None:
    """The LM head too (its dense weight stays: it may be the embedding); None where it does not fit."""
    group_size = next((g for g in (128, 64) if weight.shape[1] % g == 0), None)
    if group_size is None or weight.device.type != "cpu":
        return None
    q, scales, zeros = quantize_rtn(weight.detach(), group_size)
    return make_int4_weights(q, scales, zeros, group_size)
