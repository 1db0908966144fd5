"""Quantization methods by name (`get_quantization_method`); see `registry.QuantizationMethod` for the contract."""

from hearth.model.quantization.registry import (
    QUANTIZATION_METHODS,
    QuantizationMethod,
    get_quantization_method,
    register_quantization_method,
    supported_quantization_methods,
)

__all__ = [
    "QUANTIZATION_METHODS",
    "QuantizationMethod",
    "get_quantization_method",
    "register_quantization_method",
    "supported_quantization_methods",
]
