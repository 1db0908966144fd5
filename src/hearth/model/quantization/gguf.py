"""GGUF block-quantized linear layers (`quant_method "gguf"`, chosen for a GGUF file whose weights are
quantized), run from the file's own blocks:

- Q4_0 (`w = d * (q - 8)`), Q4_1 (`w = d * q + m`) and Q4_K (256-weight super-blocks of eight 32-weight
  groups, `w = d * sc_j * q - dmin * m_j`) are 4-bit values with a scale and an offset per 32 weights:
  exactly `hearth.ops.int4`'s layout with groups of 32 (`w = q * scale - zero_scaled`), so their nibbles
  are repacked, never dequantized, and run on the INT4 kernel with float activations (W4A16, the file's
  weights exactly; `HEARTH_INT4_ACTIVATIONS=int8` opts into W4A8, as llama.cpp's own Q4 x Q8 dot, and W8A8
  for the Q8_0 layers and head).
- Q8_0 (`w = d * q`, int8, 32 per scale) is kept as int8 and a scale per 32 (`hearth.ops.int8`): a
  quarter of float32's bytes, on the INT8 kernel (float activations; W8A8 with the opt-in above). A tied
  embedding in Q8_0 is the LM head's weight too (`quantize_lm_head`).
- A layer with a part in any other type (Q5_*, Q6_K, F16..., or a mix of the above) has no native path
  here yet: its parts are dequantized with the `gguf` library at load time and it runs as a dense layer
  (logged once per mix of types).

The parts of a fused layer (q/k/v, gate/up) arrive one at a time as `QuantizedTensor`s and are kept
until `process_after_loading`, which decides per layer.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from hearth.model.config import ModelLoadError
from hearth.model.gguf_file import QuantizedTensor
from hearth.model.quantization.registry import QuantizationMethod
from hearth.model.quantization.unquantized import UnquantizedLinearMethod
from hearth.model.weights import WeightShapeError, set_weight_attrs
from hearth.ops.int4 import BLOCK, Int4Weights, int4_linear, int8_activations_default, pack_int4
from hearth.ops.int8 import Int8Weights, int8_linear

if TYPE_CHECKING:
    from hearth.model.layers import Linear

logger = logging.getLogger(__name__)

GROUP = 32  # weights per scale in every 4-bit GGUF format
NATIVE_INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")


def _halves(raw: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at byte `start` of each block, as float32 `[rows, blocks]`."""
    return raw[..., start : start + 2].contiguous().view(torch.float16)[..., 0].float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """`[..., 16]` bytes -> the 32 values of a GGUF 4-bit group: low nibbles first, then high."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's twelve bytes of 6-bit (scale, min) pairs for its eight groups -> two `[..., 8]` int tensors."""
    s = packed.to(torch.int32)
    low = s[..., 0:4] & 63, s[..., 4:8] & 63
    high_sc = (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)
    high_m = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return torch.cat((low[0], high_sc), dim=-1), torch.cat((low[1], high_m), dim=-1)


def int4_parts(tensor: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A 4-bit GGUF tensor as (q uint8 `[rows, cols]` 0..15, scales, zero_scaled float32 `[rows, cols / 32]`)
    with `w = q * scale - zero_scaled` (the same float32 products the format's own dequantization takes)."""
    rows, cols = tensor.shape
    raw = torch.from_numpy(np.array(tensor.blocks, copy=True))  # the file is mapped read-only
    if tensor.type_name in ("Q4_0", "Q4_1"):
        width = 18 if tensor.type_name == "Q4_0" else 20
        blocks = raw.view(rows, cols // GROUP, width)
        d = _halves(blocks, 0)
        q = _nibbles(blocks[..., width - 16 :])
        zero_scaled = 8 * d if tensor.type_name == "Q4_0" else -_halves(blocks, 2)
        return q.reshape(rows, cols), d, zero_scaled
    if tensor.type_name == "Q4_K":
        blocks = raw.view(rows, cols // 256, 144)
        d, dmin = _halves(blocks, 0), _halves(blocks, 2)
        sc, m = _k_scales(blocks[..., 4:16])
        qs = blocks[..., 16:].reshape(rows, cols // 256, 4, 32)
        q = torch.stack((qs & 0x0F, qs >> 4), dim=3)  # [rows, super, chunk, low/high, 32]: group 2c + h
        scales = d[..., None] * sc.float()
        zero_scaled = dmin[..., None] * m.float()
        return q.reshape(rows, cols), scales.reshape(rows, -1), zero_scaled.reshape(rows, -1)
    raise ValueError(f"{tensor.type_name} is not a 4-bit GGUF type with a native path")


def int8_parts(tensor: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0 tensor as (q int8 `[rows, cols]`, scales float32 `[rows, cols / 32]`), `w = q * scale`."""
    rows, cols = tensor.shape
    raw = torch.from_numpy(np.array(tensor.blocks, copy=True))
    blocks = raw.view(rows, cols // GROUP, 2 + GROUP)
    return blocks[..., 2:].contiguous().view(torch.int8).reshape(rows, cols), _halves(blocks, 0)


def _int4_weights(parts: list[QuantizedTensor]) -> Int4Weights:
    """The 4-bit parts (stacked on the output dim) repacked for the INT4 kernel, with the file's numerics."""
    q, scales, zero_scaled = (torch.cat(pieces) for pieces in zip(*(int4_parts(p) for p in parts)))
    return Int4Weights(
        packed=pack_int4(q),
        scales=scales.contiguous(),
        zero_scaled=zero_scaled.contiguous(),
        group_size=GROUP,
        int8_activations=int8_activations_default(checkpoint_format=True),
    )


def _int8_weights(parts: list[QuantizedTensor]) -> Int8Weights:
    """The Q8_0 parts (stacked on the output dim) for the INT8 kernel, with the file's numerics."""
    q8, scales8 = (torch.cat(pieces) for pieces in zip(*(int8_parts(p) for p in parts)))
    return Int8Weights(
        q8.contiguous(),
        scales8.contiguous(),
        GROUP,
        int8_activations=int8_activations_default(checkpoint_format=True),
    )


class GGUFLinearMethod(QuantizationMethod):
    """Each layer keeps the file's parts (`gguf_parts`) until loaded, then holds `int4` (`Int4Weights`,
    groups of 32), `int8` (`Int8Weights`, Q8_0) or a dense weight served as the unquantized method serves it."""

    def __init__(self) -> None:
        self._dense = UnquantizedLinearMethod()
        self._dense_types: set[str] = set()

    @classmethod
    def from_config(cls, quant_config: dict[str, Any]) -> GGUFLinearMethod:
        return cls()

    def create_weights(
        self, layer: Linear, input_size: int, output_size: int, params_dtype: torch.dtype
    ) -> None:
        if layer.tp.size > 1:
            raise ModelLoadError("a quantized GGUF file is served on one rank (tensor parallelism: not yet)")
        # A placeholder under the checkpoint's name: the loader hands it each part, which `_keep_part` keeps.
        placeholder = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        set_weight_attrs(placeholder, weight_loader=partial(self._keep_part, layer), gguf_blocks=True)
        layer.register_parameter("weight", placeholder)
        layer.gguf_parts = {}
        layer.gguf_dtype = params_dtype

    def _keep_part(
        self, layer: Linear, param: nn.Parameter, loaded: torch.Tensor | QuantizedTensor, shard_id: Any = None
    ) -> None:
        shard = layer.output_shards.get(shard_id)
        if shard is None:
            raise ModelLoadError(
                f"loads into part {shard_id!r}, but this layer's parts are {list(layer.output_shards)}"
            )
        expected = (shard.full_size, layer.input_size)
        if tuple(loaded.shape) != expected:
            raise WeightShapeError(tuple(loaded.shape), expected)
        layer.gguf_parts[shard_id] = loaded

    def process_after_loading(self, layer: Linear) -> None:
        parts = [layer.gguf_parts[shard] for shard in layer.output_shards]
        del layer.gguf_parts, layer.weight
        native = all(isinstance(p, QuantizedTensor) and p.type_name in NATIVE_INT4_TYPES for p in parts)
        if native and layer.input_size % BLOCK == 0:
            layer.int4 = _int4_weights(parts)
            return
        if all(isinstance(p, QuantizedTensor) and p.type_name == "Q8_0" for p in parts):
            layer.int8 = _int8_weights(parts)
            return
        types = {p.type_name if isinstance(p, QuantizedTensor) else str(p.dtype) for p in parts}
        if not types <= self._dense_types:
            self._dense_types |= types
            logger.info(
                "GGUF: layers with %s parts run dense (dequantized at load)", ", ".join(sorted(types))
            )
        dense = torch.cat([p.dequantize() if isinstance(p, QuantizedTensor) else p.float() for p in parts])
        layer.weight = nn.Parameter(dense.to(layer.gguf_dtype), requires_grad=False)
        self._dense.process_after_loading(layer)

    def quantize_lm_head(self, weight: torch.Tensor) -> Int4Weights | Int8Weights | None:
        """The head on the file's own blocks (a tied head: the embedding's, which the loader keeps beside its
        dense copy as `gguf_source`): Q8_0 on the INT8 kernel, 4-bit types on the INT4 kernel. None (the
        dense path) for other types."""
        source = getattr(weight, "gguf_source", None)
        if not isinstance(source, QuantizedTensor) or tuple(source.shape) != tuple(weight.shape):
            return None
        if weight.device.type != "cpu":
            return None
        if source.type_name == "Q8_0":
            return _int8_weights([source])
        if source.type_name in NATIVE_INT4_TYPES and source.shape[1] % BLOCK == 0:
            return _int4_weights([source])
        return None

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        weights: Int4Weights | None = getattr(layer, "int4", None)
        if weights is not None:
            return int4_linear(x, weights, bias)
        weights8: Int8Weights | None = getattr(layer, "int8", None)
        if weights8 is not None:
            return int8_linear(x, weights8, bias)
        return self._dense.apply(layer, x, bias)
