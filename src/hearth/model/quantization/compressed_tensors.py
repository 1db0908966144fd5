"""compressed-tensors W4A16 checkpoints (`quant_method == "compressed-tensors"`, format "pack-quantized",
as llm-compressor writes them), per linear layer:

- `weight_packed` int32 `[out, in / 8]`: signed 4-bit values plus 8 (offset coding), value j of an int32 in
  bits 4j..4j+3, along the input features;
- `weight_scale` `[out, groups]`; for asymmetric schemes `weight_zero_point` int32 `[out / 8, groups]`
  (signed zero points, packed the same way along the output features);
- `weight_shape` (the unpacked shape) and, with `actorder`, `weight_g_idx` `[in]`.

`w = (q - zero) * scale` in signed units, i.e. `(nibble - (zero + 8)) * scale`. Layers the config's
`ignore` names (usually `lm_head`) are dense; this engine's LM head always is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from hearth.model.config import ModelLoadError
from hearth.model.quantization.int4 import (
    PACK,
    Int4LinearMethod,
    add_param,
    check_divisible,
    load_g_idx,
    unpack_int32,
)

if TYPE_CHECKING:
    from hearth.model.layers import Linear

OFFSET = 8


def _ignore_loader(param: torch.nn.Parameter, loaded: torch.Tensor, shard: Any = None) -> None:
    """`weight_shape` restates the layer's shape; nothing to keep."""


class CompressedTensorsW4A16Method(Int4LinearMethod):
    def __init__(self, group_size: int = 128, symmetric: bool = True, actorder: bool = False) -> None:
        self.group_size = group_size
        self.symmetric = symmetric
        self.actorder = actorder

    @classmethod
    def from_config(cls, quant_config: dict[str, Any]) -> CompressedTensorsW4A16Method:
        fmt = quant_config.get("format", "pack-quantized")
        groups = list((quant_config.get("config_groups") or {}).values())
        if fmt != "pack-quantized" or len(groups) != 1:
            raise ModelLoadError(
                f"compressed-tensors: only one 'pack-quantized' W4A16 scheme is supported (format {fmt!r}, "
                f"{len(groups)} config groups)"
            )
        weights = groups[0].get("weights") or {}
        if int(weights.get("num_bits", 0)) != 4 or weights.get("type", "int") != "int":
            raise ModelLoadError(f"compressed-tensors: weights {weights} are not 4-bit integers")
        if groups[0].get("input_activations"):
            raise ModelLoadError("compressed-tensors: quantized activations are not supported (W4A16 only)")
        if weights.get("strategy", "group") != "group":
            raise ModelLoadError(f"compressed-tensors: strategy {weights.get('strategy')!r} (group only)")
        return cls(
            group_size=int(weights.get("group_size") or 128),
            symmetric=bool(weights.get("symmetric", True)),
            actorder=weights.get("actorder") in ("group", True),
        )

    def create_weights(
        self, layer: Linear, input_size: int, output_size: int, params_dtype: torch.dtype
    ) -> None:
        check_divisible(layer, input_size, output_size, self.group_size)
        groups = input_size // self.group_size
        add_param(
            layer,
            "weight_packed",
            (output_size, input_size // PACK),
            torch.int32,
            output_dim=0,
            input_dim=1,
            input_pack=PACK,
        )
        add_param(
            layer,
            "weight_scale",
            (output_size, groups),
            torch.float32,
            output_dim=0,
            input_dim=1,
            input_pack=self.group_size,
        )
        add_param(layer, "weight_shape", (2,), torch.int64, weight_loader=_ignore_loader)
        if not self.symmetric:
            add_param(
                layer,
                "weight_zero_point",
                (output_size // PACK, groups),
                torch.int32,
                output_dim=0,
                input_dim=1,
                output_pack=PACK,
                input_pack=self.group_size,
            )
        if self.actorder:
            add_param(
                layer,
                "weight_g_idx",
                (input_size,),
                torch.int32,
                input_dim=0,
                weight_loader=lambda p, w, shard=None: load_g_idx(layer, p, w, shard),
            )

    def checkpoint_params(self) -> tuple[str, ...]:
        names = ["weight_packed", "weight_scale", "weight_shape"]
        names += [] if self.symmetric else ["weight_zero_point"]
        return tuple(names + (["weight_g_idx"] if self.actorder else []))

    def unpack(self, layer: Linear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        q = unpack_int32(layer.weight_packed.data, dim=1)  # [out, in], nibble = signed + 8
        scales = layer.weight_scale.data
        if self.symmetric:
            zeros = torch.full_like(scales, OFFSET)
        else:
            zeros = unpack_int32(layer.weight_zero_point.data, dim=0).float()  # signed zero + 8
        return q, scales, zeros, layer.weight_g_idx.data if self.actorder else None
