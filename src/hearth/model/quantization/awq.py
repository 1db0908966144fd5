"""AWQ 4-bit checkpoints (`quant_method == "awq"`, the GEMM layout AutoAWQ writes), per linear layer:

- `qweight` int32 `[in, out / 8]`: 8 output features per int32, in AutoAWQ's interleaved order (nibble j
  holds output feature `AWQ_ORDER[j]` of its eight);
- `qzeros` int32 `[groups, out / 8]`, the same packing; `scales` `[groups, out]` (fp16).

`w[o, i] = (q[i, o] - zero[i // group_size, o]) * scale[i // group_size, o]`; no act-order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from hearth.model.config import ModelLoadError
from hearth.model.quantization.int4 import PACK, Int4LinearMethod, add_param, check_divisible, unpack_int32

if TYPE_CHECKING:
    from hearth.model.layers import Linear

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble j of an int32 holds output feature AWQ_ORDER[j]
AWQ_REVERSE_ORDER = tuple(AWQ_ORDER.index(i) for i in range(PACK))  # output feature c is nibble [c]


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 `[rows, out / 8]` -> uint8 `[rows, out]` in output-feature order."""
    nibbles = unpack_int32(packed, dim=1).view(packed.shape[0], -1, PACK)
    return nibbles[:, :, list(AWQ_REVERSE_ORDER)].reshape(packed.shape[0], -1)


class AWQLinearMethod(Int4LinearMethod):
    def __init__(self, group_size: int = 128) -> None:
        self.group_size = group_size

    @classmethod
    def from_config(cls, quant_config: dict[str, Any]) -> AWQLinearMethod:
        bits = int(quant_config.get("bits", quant_config.get("w_bit", 4)))
        version = str(quant_config.get("version", "gemm")).lower()
        if bits != 4 or version != "gemm":
            raise ModelLoadError(f"AWQ {bits}-bit version {version!r} is not supported (4-bit GEMM only)")
        if not quant_config.get("zero_point", True):
            raise ModelLoadError("AWQ without zero points is not supported")
        return cls(group_size=int(quant_config.get("group_size", quant_config.get("q_group_size", 128))))

    def create_weights(
        self, layer: Linear, input_size: int, output_size: int, params_dtype: torch.dtype
    ) -> None:
        check_divisible(layer, input_size, output_size, self.group_size)
        groups = input_size // self.group_size
        add_param(
            layer,
            "qweight",
            (input_size, output_size // PACK),
            torch.int32,
            input_dim=0,
            output_dim=1,
            output_pack=PACK,
        )
        add_param(
            layer,
            "qzeros",
            (groups, output_size // PACK),
            torch.int32,
            input_dim=0,
            output_dim=1,
            input_pack=self.group_size,
            output_pack=PACK,
        )
        add_param(
            layer,
            "scales",
            (groups, output_size),
            torch.float32,
            input_dim=0,
            output_dim=1,
            input_pack=self.group_size,
        )

    def checkpoint_params(self) -> tuple[str, ...]:
        return ("qweight", "qzeros", "scales")

    def unpack(self, layer: Linear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        q = unpack_awq(layer.qweight.data).t()  # [out, in]
        zeros = unpack_awq(layer.qzeros.data).t().float()  # [out, groups]
        return q, layer.scales.data.t(), zeros, None
