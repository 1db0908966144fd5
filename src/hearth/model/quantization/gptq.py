"""GPTQ 4-bit checkpoints (`quantization_config.quant_method == "gptq"`), as AutoGPTQ/GPTQModel/optimum
write them, per linear layer:

- `qweight` int32 `[in / 8, out]`: 8 weights of consecutive input features per int32 (feature 8r + j in
  bits 4j..4j+3), unsigned 0..15;
- `qzeros` int32 `[groups, out / 8]`: zero points packed the same way along the output features; the
  original ("gptq", v1) format stores zero - 1 (GPTQModel's "gptq_v2" stores the zero itself);
- `scales` `[groups, out]` (fp16); `g_idx` int32 `[in]`: each input feature's group (act-order: not
  `i // group_size`).

`w[o, i] = (q[i, o] - zero[g_idx[i], o]) * scale[g_idx[i], o]`.
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


class GPTQLinearMethod(Int4LinearMethod):
    def __init__(self, group_size: int = 128, zero_offset: int = 1) -> None:
        self.group_size = group_size
        self.zero_offset = zero_offset  # what the stored zeros lack: 1 in the v1 format

    @classmethod
    def from_config(cls, quant_config: dict[str, Any]) -> GPTQLinearMethod:
        bits = int(quant_config.get("bits", 4))
        if bits != 4:
            raise ModelLoadError(f"GPTQ with {bits} bits is not supported (4 only)")
        group_size = int(quant_config.get("group_size", 128))
        fmt = quant_config.get("checkpoint_format", "gptq")
        return cls(group_size=group_size, zero_offset=0 if fmt == "gptq_v2" else 1)

    def _group_size(self, input_size: int) -> int:
        return input_size if self.group_size == -1 else self.group_size

    def create_weights(
        self, layer: Linear, input_size: int, output_size: int, params_dtype: torch.dtype
    ) -> None:
        group_size = self._group_size(input_size)
        layer.int4_group_size = group_size
        check_divisible(layer, input_size, output_size, group_size)
        groups = input_size // group_size
        add_param(
            layer,
            "qweight",
            (input_size // PACK, output_size),
            torch.int32,
            input_dim=0,
            output_dim=1,
            input_pack=PACK,
        )
        add_param(
            layer,
            "qzeros",
            (groups, output_size // PACK),
            torch.int32,
            input_dim=0,
            output_dim=1,
            input_pack=group_size,
            output_pack=PACK,
        )
        add_param(
            layer,
            "scales",
            (groups, output_size),
            torch.float32,
            input_dim=0,
            output_dim=1,
            input_pack=group_size,
        )
        add_param(
            layer,
            "g_idx",
            (input_size,),
            torch.int32,
            input_dim=0,
            weight_loader=lambda p, w, shard=None: load_g_idx(layer, p, w, shard),
        )

    def checkpoint_params(self) -> tuple[str, ...]:
        return ("qweight", "qzeros", "scales", "g_idx")

    def unpack(self, layer: Linear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        self.group_size = layer.int4_group_size
        q = unpack_int32(layer.qweight.data, dim=0).t()  # [out, in]
        zeros = unpack_int32(layer.qzeros.data, dim=1).t().float() + self.zero_offset  # [out, groups]
        return q, layer.scales.data.t(), zeros, layer.g_idx.data
