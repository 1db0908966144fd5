"""Dense weights in the model's dtype: today's path, with the CPU layouts of `hearth.ops.linear`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from hearth.model.quantization.registry import QuantizationMethod
from hearth.model.weights import set_weight_attrs
from hearth.ops.linear import linear, prepare_linear_weights

if TYPE_CHECKING:
    from hearth.model.layers import Linear


class UnquantizedLinearMethod(QuantizationMethod):
    """One `[out, in]` weight. On CPU, `process_after_loading` lays it out for the fast paths (oneDNN
    prepacked, an exact bf16 copy for few rows) into `layer.prepared`, and drops the float32 `weight`
    where the prepacked copy serves every row count; elsewhere `apply` is `F.linear`."""

    def create_weights(
        self, layer: Linear, input_size: int, output_size: int, params_dtype: torch.dtype
    ) -> None:
        weight = nn.Parameter(torch.empty(output_size, input_size, dtype=params_dtype), requires_grad=False)
        set_weight_attrs(weight, weight_loader=layer.weight_loader, output_dim=0, input_dim=1)
        layer.register_parameter("weight", weight)

    def process_after_loading(self, layer: Linear) -> None:
        if layer.weight.device.type != "cpu":
            return
        layer.prepared = prepare_linear_weights(layer.weight)
        if layer.prepared.fp32 is None:
            layer.weight = None  # type: ignore[assignment]

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        prepared = layer.prepared
        if prepared is None:
            return F.linear(x, layer.weight, bias)
        return linear(x, prepared, bias)
