"""FP8 block-scaled weights (`quant_method == "fp8"` with `weight_block_size`, the DeepSeek-V3 / Kimi K2
format): `weight` float8_e4m3fn `[out, in]` and `weight_scale_inv` float32 `[ceil(out / bo), ceil(in / bi)]`,
`w = weight * weight_scale_inv[o // bo, i // bi]`.

This CPU has no FP8 math, so each layer is dequantized once at load, block by block, into the dense
layouts of the unquantized path (`hearth.ops.linear`). The checkpoint loads and runs; its memory saving
does not carry over.

`--quantization int4` on such a checkpoint (`fp8-int4`, chosen by `select.resolve_quantization`): each layer
is dequantized per block as above, then rounded to INT4 per group (RTN, as for a dense checkpoint) and served
by the INT4 kernel; the LM head too. This is the "INT4 from FP8" decode-server setup: ~4x fewer weight bytes
than the FP8 checkpoint's dequantized float32, ~2x fewer than its FP8 bytes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from hearth.model.config import ModelLoadError
from hearth.model.quantization.int4 import add_param, rtn_group_size, rtn_lm_head
from hearth.model.quantization.registry import QuantizationMethod
from hearth.model.quantization.unquantized import UnquantizedLinearMethod
from hearth.model.weights import ShardId
from hearth.ops.int4 import Int4Weights, int4_linear, make_int4_weights, quantize_rtn

if TYPE_CHECKING:
    from hearth.model.layers import Linear


def dequantize_fp8_blocks(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int],
    start: tuple[int, int] = (0, 0),
) -> torch.Tensor:
    """float32 `[out, in]` from an FP8 `weight` and its per-block `scale_inv`. `start`: where `weight` begins
    in the whole tensor `scale_inv` covers (a tensor-parallel rank's slice need not start on a block)."""
    out, k = weight.shape
    if start != (0, 0):
        rows = torch.arange(start[0], start[0] + out) // block[0]
        cols = torch.arange(start[1], start[1] + k) // block[1]
        return weight.float() * scale_inv.float()[rows][:, cols]
    scales = (
        scale_inv.float().repeat_interleave(block[0], dim=0)[:out].repeat_interleave(block[1], dim=1)[:, :k]
    )
    return weight.float() * scales


def quantize_fp8_blocks(
    weight: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """The format's writer (DeepSeek-V3's conversion): `scale_inv[bo, bi]` = the block's |max| / 448 (e4m3's
    largest finite value), `weight / scale_inv` rounded to float8_e4m3fn. For demo conversions
    (`scripts/convert_fp8_block.py`); checkpoints in the wild come quantized."""
    out, k = weight.shape
    grid = (-(-out // block[0]), -(-k // block[1]))
    padded = torch.zeros(grid[0] * block[0], grid[1] * block[1])
    padded[:out, :k] = weight.float().abs()
    amax = padded.view(grid[0], block[0], grid[1], block[1]).amax(dim=(1, 3)).clamp(min=1e-12)
    scale_inv = amax / torch.finfo(torch.float8_e4m3fn).max
    full = scale_inv.repeat_interleave(block[0], 0)[:out].repeat_interleave(block[1], 1)[:, :k]
    return (weight.float() / full).to(torch.float8_e4m3fn), scale_inv


class Fp8BlockLinearMethod(QuantizationMethod):
    def __init__(self, block: tuple[int, int] = (128, 128)) -> None:
        self.block = block

    @classmethod
    def from_config(cls, quant_config: dict[str, Any]) -> Fp8BlockLinearMethod:
        block = quant_config.get("weight_block_size")
        if not block or len(block) != 2:
            raise ModelLoadError("FP8 weights without weight_block_size (per-tensor FP8) are not supported")
        if quant_config.get("fmt", "e4m3") != "e4m3":
            raise ModelLoadError(f"FP8 weights in {quant_config.get('fmt')!r} are not supported (e4m3 only)")
        return cls((int(block[0]), int(block[1])))

    def create_weights(
        self, layer: Linear, input_size: int, output_size: int, params_dtype: torch.dtype
    ) -> None:
        add_param(layer, "weight", (output_size, input_size), torch.float8_e4m3fn, output_dim=0, input_dim=1)
        layer.fp8_block_scales = {}

        def load_scale(param: torch.nn.Parameter, loaded: torch.Tensor, shard: ShardId | None = None) -> None:
            # Each part of a fused layer (q/k/v) has its own block grid: kept per part, applied per part.
            layer.fp8_block_scales[shard] = loaded.float()

        add_param(layer, "weight_scale_inv", (1,), torch.float32, weight_loader=load_scale)

    def dequantize(self, layer: Linear) -> torch.Tensor:
        """The layer's weight, dequantized per block (per part of a fused layer); drops the FP8 tensors."""
        weight = layer.weight.data
        dense = torch.empty(
            weight.shape, dtype=torch.get_default_dtype() if weight.device.type != "cpu" else torch.float32
        )
        col_start = layer.input_shard[0]  # a tensor-parallel rank holds a slice: its blocks start mid-grid
        for shard_id, shard in layer.output_shards.items():
            scale_inv = layer.fp8_block_scales.get(shard_id)
            if scale_inv is None:
                raise ModelLoadError(f"FP8 weights: no weight_scale_inv for part {shard_id!r}")
            rows = slice(shard.local_offset, shard.local_offset + shard.size)
            dense[rows] = dequantize_fp8_blocks(
                weight[rows], scale_inv, self.block, (shard.source_start, col_start)
            )
        del layer.weight, layer.weight_scale_inv
        layer.fp8_block_scales = {}
        return dense

    def process_after_loading(self, layer: Linear) -> None:
        dense = self.dequantize(layer)
        layer.weight = torch.nn.Parameter(dense, requires_grad=False)
        self._dense = UnquantizedLinearMethod()
        self._dense.process_after_loading(layer)

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return UnquantizedLinearMethod.apply(self._dense, layer, x, bias)


class Fp8BlockToInt4Method(Fp8BlockLinearMethod):
    """`--quantization int4` on an FP8 block-scaled checkpoint: dequantize per block, then RTN per group."""

    def create_weights(
        self, layer: Linear, input_size: int, output_size: int, params_dtype: torch.dtype
    ) -> None:
        rtn_group_size(input_size)  # refuse a shape INT4 cannot hold before anything is read
        super().create_weights(layer, input_size, output_size, params_dtype)

    def process_after_loading(self, layer: Linear) -> None:
        dense = self.dequantize(layer)
        group_size = rtn_group_size(dense.shape[1])
        q, scales, zeros = quantize_rtn(dense, group_size)
        layer.int4 = make_int4_weights(q, scales, zeros, group_size)

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return int4_linear(x, layer.int4, bias)

    def quantize_lm_head(self, weight: torch.Tensor) -> Int4Weights | None:
        # DeepSeek-V3 ships its head in BF16; it is rounded as `--quantization int4` rounds a dense one.
        return rtn_lm_head(weight)
