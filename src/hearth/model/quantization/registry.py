"""Quantization methods, chosen by name: how a linear layer stores its weights and multiplies by them.

Adding one (INT4 GPTQ/AWQ, FP8 block weights) is a new module that subclasses `QuantizationMethod`
and registers under its names with `@register_quantization_method("name")`, plus its import in
`_ensure_registered`; the layers and the loader stay as they are.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from hearth.model.config import ModelLoadError

if TYPE_CHECKING:
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
_METHODS: dict[str, type[QuantizationMethod]] = {}
_MODULES = (
    "hearth.model.quantization.unquantized",
    "hearth.model.quantization.int4",
    "hearth.model.quantization.gptq",
    "hearth.model.quantization.awq",
    "hearth.model.quantization.compressed_tensors",
    "hearth.model.quantization.fp8_block",
    "hearth.model.quantization.gguf",
)


def register_quantization_method(*names: str) -> Callable[[M], M]:
    """Class decorator: serve `--quantization NAME` with this method, for each of `names`."""

    def register(cls: M) -> M:
        for name in names:
            if name in _METHODS and _METHODS[name] is not cls:
                raise ValueError(
                    f"quantization method {name!r} is already registered by {_METHODS[name].__name__}"
                )
            _METHODS[name] = cls
        return cls

    return register


def _ensure_registered() -> None:
    for module in _MODULES:
        importlib.import_module(module)


def supported_quantization_methods() -> tuple[str, ...]:
    _ensure_registered()
    return tuple(sorted(_METHODS))


def get_quantization_method(name: str, quant_config: dict[str, Any] | None = None) -> QuantizationMethod:
    """A new instance of the method registered as `name` (configured by the checkpoint's
    `quantization_config` when given); a ModelLoadError naming the known ones otherwise."""
    _ensure_registered()
    cls = _METHODS.get(name)
    if cls is None:
        raise ModelLoadError(
            f"quantization method {name!r} is not supported; supported: {', '.join(supported_quantization_methods())}"
        )
    return cls() if quant_config is None else cls.from_config(quant_config)
