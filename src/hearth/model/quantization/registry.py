"""Quantization methods, chosen by name: how a linear layer stores its weights and multiplies by them.

Adding one (INT4 GPTQ/AWQ, FP8 block weights) is a new module that subclasses `QuantizationMethod`, plus
one line in `QUANTIZATION_METHODS` below; the layers and the loader stay as they are. The entries are lazy,
so this module imports no torch: the config can name the methods without loading one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from hearth.contracts.registry import Registry

if TYPE_CHECKING:
    import torch

    from hearth.model.layers import Linear


class QuantizationMethod(ABC):
    """How one `Linear` holds and applies its weight. One instance may serve every layer of a model:
    all per-layer state lives on the layer.

    Contract, in the order the loader calls it:
    - `create_weights(layer, input_size, output_size, params_dtype)` registers the layer's weight
      parameters for this rank's `[output_size, input_size]` slice of the product (already divided by
      the tensor-parallel size), on whatever device the model is being built on (usually meta). Each
      parameter gets `set_weight_attrs(param, weight_loader=layer.weight_loader, output_dim=...,
      input_dim=...)`: the dims that hold the output and input features (None for a dim sharding
      must not split, e.g. a per-tensor scale), so the layer's loader can slice the checkpoint tensor
      for this rank and place a fused part (`layer.output_partition_sizes`, per-rank) at its offset.
      The bias, when the layer has one, is the layer's and is not created here.
    - `process_after_loading(layer)` runs once all weights are loaded: repack, requantize, build
      the layouts `apply` uses, and drop what `apply` will not read, so weights are not held twice.
    - `apply(layer, x, bias)` returns `x @ W.T + bias` for `x[rows, input_size]`, in `x`'s dtype.
      It runs in every forward: keep it to a dispatch.
    """

    @classmethod
    def from_config(cls, quant_config: dict[str, Any]) -> QuantizationMethod:
        """An instance for a checkpoint's `quantization_config` (config.json); methods without options ignore it."""
        return cls()

    @abstractmethod
    def create_weights(
        self, layer: Linear, input_size: int, output_size: int, params_dtype: torch.dtype
    ) -> None: ...

    @abstractmethod
    def process_after_loading(self, layer: Linear) -> None: ...

    @abstractmethod
    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...


M = TypeVar("M", bound=type[QuantizationMethod])

QUANTIZATION_METHODS: Registry[type[QuantizationMethod]] = Registry("quantization method")
QUANTIZATION_METHODS.add(
    "unquantized", "hearth.model.quantization.unquantized:UnquantizedLinearMethod", aliases=("none",)
)
QUANTIZATION_METHODS.add("int4", "hearth.model.quantization.int4:RTNInt4Method")
QUANTIZATION_METHODS.add("gptq", "hearth.model.quantization.gptq:GPTQLinearMethod")
QUANTIZATION_METHODS.add("awq", "hearth.model.quantization.awq:AWQLinearMethod")
QUANTIZATION_METHODS.add(
    "compressed-tensors",
    "hearth.model.quantization.compressed_tensors:CompressedTensorsW4A16Method",
    aliases=("compressed_tensors",),
)
QUANTIZATION_METHODS.add("fp8", "hearth.model.quantization.fp8_block:Fp8BlockLinearMethod")
QUANTIZATION_METHODS.add("fp8-int4", "hearth.model.quantization.fp8_block:Fp8BlockToInt4Method")
QUANTIZATION_METHODS.add("gguf", "hearth.model.quantization.gguf:GGUFLinearMethod")


def register_quantization_method(*names: str) -> Callable[[M], M]:
    """Class decorator for a method defined outside this package: serve `--quantization NAME` with it
    (the first of `names` is its name, the rest aliases)."""

    def register(cls: M) -> M:
        QUANTIZATION_METHODS.add(names[0], cls, aliases=names[1:])
        return cls

    return register


def supported_quantization_methods() -> tuple[str, ...]:
    return QUANTIZATION_METHODS.choices()


def get_quantization_method(name: str, quant_config: dict[str, Any] | None = None) -> QuantizationMethod:
    """A new instance of the method registered as `name` (configured by the checkpoint's
    `quantization_config` when given); an UnknownNameError naming the known ones otherwise."""
    cls = QUANTIZATION_METHODS.get(name)
    return cls() if quant_config is None else cls.from_config(quant_config)
