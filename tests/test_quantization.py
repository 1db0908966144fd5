"""The quantization-method registry: methods are chosen by name, and a method owns how a linear
layer's weights are created, loaded, processed and applied."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hearth.contracts.registry import UnknownNameError
from hearth.model.config import ModelConfig
from hearth.model.layers import Linear, MergedColumnParallelLinear
from hearth.model.loader import load_model
from hearth.model.quantization import (
    QUANTIZATION_METHODS,
    QuantizationMethod,
    get_quantization_method,
    register_quantization_method,
    registry,
    supported_quantization_methods,
)
from hearth.model.quantization.select import QUANTIZATION_CHOICES
from hearth.model.quantization.unquantized import UnquantizedLinearMethod
from hearth.model.weights import set_weight_attrs


def test_unquantized_is_served_by_name():
    assert {"none", "unquantized"} <= set(supported_quantization_methods())
    assert isinstance(get_quantization_method("unquantized"), UnquantizedLinearMethod)
    assert isinstance(get_quantization_method("none"), UnquantizedLinearMethod)
    with pytest.raises(
        UnknownNameError, match="unknown quantization method 'int3'; choose one of .*unquantized"
    ):
        get_quantization_method("int3")


def test_every_quantization_choice_but_auto_is_a_registered_method():
    assert set(QUANTIZATION_CHOICES) - {"auto"} <= set(QUANTIZATION_METHODS.choices())


def test_unquantized_off_cpu_keeps_the_weight_and_uses_f_linear():
    with torch.device("meta"):
        layer = Linear(8, 4, bias=True)
    layer.quant_method.process_after_loading(layer)
    assert layer.prepared is None and layer.weight is not None
    assert layer(torch.empty(3, 8, device="meta")).shape == (3, 4)


class TransposedMethod(QuantizationMethod):
    """Holds `weight` as W^T `[in, out]` (the layout packed INT4 weights use: checkpoint tensors keep their
    names, not their layout), loaded by wrapping the layer's loader."""

    def __init__(self) -> None:
        self.processed: list[Linear] = []

    def create_weights(self, layer, input_size, output_size, params_dtype):
        weight_t = nn.Parameter(torch.empty(input_size, output_size, dtype=params_dtype), requires_grad=False)

        def load_transposed(param, loaded_weight, shard_id=None):
            layer.weight_loader(param, loaded_weight.t(), shard_id)

        set_weight_attrs(weight_t, weight_loader=load_transposed, output_dim=1, input_dim=0)
        layer.register_parameter("weight", weight_t)

    def process_after_loading(self, layer):
        self.processed.append(layer)

    def apply(self, layer, x, bias):
        out = x @ layer.weight
        return out if bias is None else out + bias


def test_a_registered_method_creates_loads_processes_and_applies(monkeypatch, tiny_model_factory):
    monkeypatch.setattr(registry, "QUANTIZATION_METHODS", registry.QUANTIZATION_METHODS.copy())
    register_quantization_method("test-transposed")(TransposedMethod)
    model_dir = tiny_model_factory("qwen2")  # fused q/k/v with biases, fused gate/up
    config = ModelConfig.from_dir(model_dir)
    quantized = load_model(model_dir, config, torch.float32, 64, quantization="test-transposed")
    reference = load_model(model_dir, config, torch.float32, 64)
    pairs = [(a, b) for a, b in zip(quantized.modules(), reference.modules()) if isinstance(a, Linear)]
    assert len(pairs) == 2 * 4  # qkv, o, gate_up, down in each of 2 layers
    method = pairs[0][0].quant_method
    assert isinstance(method, TransposedMethod) and method.processed == [a for a, _ in pairs]
    with torch.no_grad():
        for a, b in pairs:
            assert a.weight.shape == (a.input_size, a.output_size) and a.prepared is None
            x = torch.randn(5, a.input_size)
            torch.testing.assert_close(a(x), b(x), rtol=1e-5, atol=1e-5)


def test_fused_layer_reports_its_per_rank_partitions():
    with torch.device("meta"):
        layer = MergedColumnParallelLinear(8, [6, 10])
    assert layer.output_partition_sizes == [6, 10]
    assert layer.weight.shape == (16, 8) and layer.weight.shard_ids == (0, 1)
