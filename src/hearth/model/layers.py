"""Building blocks of the decoder families we serve. Parameter names follow Hugging Face's, except the
fused projections (`qkv_proj`, `gate_up_proj`) that each fill from the separate checkpoint tensors
through their parameters' weight loaders (`hearth.model.weights`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from hearth.model.config import ModelConfig, ModelLoadError
from hearth.model.lazy_tensor import materialize
from hearth.model.quantization.registry import QuantizationMethod
from hearth.model.quantization.unquantized import UnquantizedLinearMethod
from hearth.model.rotary import apply_rotary
from hearth.model.weights import ShardId, TPRank, WeightShapeError, divide, set_weight_attrs
from hearth.ops.attention import AttentionContext
from hearth.ops.cpu_kernels import (
    rms_norm_kernel,
    rotary_write_kv_bf16_kernel,
    rotary_write_kv_fp8_kernel,
    rotary_write_kv_kernel,
    silu_and_mul_bf16_kernel,
)
from hearth.ops.fp8 import is_fp8
from hearth.ops.int4 import Int4Weights
from hearth.ops.int8 import Int8Weights
from hearth.ops.linear import LinearWeights
from hearth.ops.prefill_math import bf16_rows
from hearth.ops.triton import use_triton_kernels
from hearth.parallel.state import all_reduce_tp

ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


@dataclass(frozen=True)
class LayerOptions:
    """How a model's layers are built for this process: its tensor-parallel slot, the quantization
    method of its linear layers (one instance serves them all), and the decoder layers its pipeline
    stage holds (None: all of them)."""

    tp: TPRank = TPRank()
    quant_method: QuantizationMethod = field(default_factory=UnquantizedLinearMethod)
    layers: range | None = None


class OutputShard(NamedTuple):
    """Where one part of a (fused) output dim lives: `size` rows from `source_start` of the
    checkpoint tensor (whose output dim has `full_size` rows) go to `local_offset` of this rank's parameter."""

    local_offset: int
    size: int
    source_start: int
    full_size: int


class Linear(nn.Module):
    """`y = x W^T + b`, with `W` held and applied by a quantization method. This base is replicated:
    every tensor-parallel rank holds the whole weight. Subclasses say which rows and columns of the
    checkpoint tensors a rank holds (`_output_shards`, `_input_shard`); one `weight_loader` serves all.

    `prepared` is the unquantized method's CPU layouts (`hearth.ops.linear`), None until prepared.
    """

    prepared: LinearWeights | None = None

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, options: LayerOptions | None = None
    ) -> None:
        super().__init__()
        options = options or LayerOptions()
        self.tp = options.tp
        self.input_size = input_size  # whole, as in the checkpoint
        self.output_size = output_size
        self.output_shards: dict[ShardId | None, OutputShard] = self._output_shards()
        self.input_shard: tuple[int, int] = self._input_shard()  # (source_start, size) of the input dim
        self.output_size_per_rank = sum(shard.size for shard in self.output_shards.values())
        self.input_size_per_rank = self.input_shard[1]
        self.output_partition_sizes = [shard.size for shard in self.output_shards.values()]
        self.quant_method = options.quant_method
        params_dtype = torch.get_default_dtype()
        self.quant_method.create_weights(
            self, self.input_size_per_rank, self.output_size_per_rank, params_dtype
        )
        if bias:
            self.bias = nn.Parameter(
                torch.empty(self.output_size_per_rank, dtype=params_dtype), requires_grad=False
            )
            set_weight_attrs(self.bias, weight_loader=self.weight_loader, output_dim=0)
        else:
            self.register_parameter("bias", None)
        shard_ids = tuple(self.output_shards)
        for param in self.parameters(recurse=False):
            if not hasattr(param, "shard_ids"):
                set_weight_attrs(param, shard_ids=shard_ids)
            if getattr(param, "weight_loader", None) == self.weight_loader:
                set_weight_attrs(param, lazy_loading=True)  # it narrows, then reads: a LazyTensor will do

    def _output_shards(self) -> dict[ShardId | None, OutputShard]:
        return {None: OutputShard(0, self.output_size, 0, self.output_size)}

    def _input_shard(self) -> tuple[int, int]:
        return 0, self.input_size

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId | None = None
    ) -> None:
        """Copy this rank's part of the whole checkpoint tensor `loaded_weight` (part `shard_id` of a
        fused parameter) into `param`: views of both sides and one copy, no intermediate tensor."""
        shard = self.output_shards.get(shard_id)
        if shard is None:
            raise ModelLoadError(
                f"loads into part {shard_id!r}, but this layer's parts are {[s for s in self.output_shards]}"
            )
        output_dim: int | None = getattr(param, "output_dim", None)
        input_dim: int | None = getattr(param, "input_dim", None)
        # Packed or grouped dims (INT4 nibbles per int32, one scale per group) hold 1/pack of the features.
        out_pack: int = getattr(param, "output_pack", 1)
        in_pack: int = getattr(param, "input_pack", 1)
        expected = list(param.shape)
        if output_dim is not None:
            expected[output_dim] = shard.full_size // out_pack
        if input_dim is not None:
            expected[input_dim] = self.input_size // in_pack
        if tuple(loaded_weight.shape) != tuple(expected):
            raise WeightShapeError(loaded_weight.shape, tuple(expected))
        target = param.data
        if output_dim is not None:
            target = target.narrow(output_dim, shard.local_offset // out_pack, shard.size // out_pack)
            loaded_weight = loaded_weight.narrow(
                output_dim, shard.source_start // out_pack, shard.size // out_pack
            )
        if input_dim is not None:
            start, size = self.input_shard
            loaded_weight = loaded_weight.narrow(input_dim, start // in_pack, size // in_pack)
        target.copy_(materialize(loaded_weight))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size_per_rank}, out={self.output_size_per_rank}, bias={self.bias is not None}, "
            f"{type(self.quant_method).__name__}"
        )


class ColumnParallelLinear(Linear):
    """Output features split across ranks: rank r holds rows `[r * n, (r + 1) * n)` of the weight."""

    def _output_shards(self) -> dict[ShardId | None, OutputShard]:
        size = divide(self.output_size, self.tp.size, "output size")
        return {None: OutputShard(0, size, self.tp.rank * size, self.output_size)}


class MergedColumnParallelLinear(Linear):
    """Several column-parallel projections of one input in one matrix (`gate_up_proj`): part `i` is
    checkpoint tensor `i`, and each rank holds its slice of every part, the parts one after another."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        options: LayerOptions | None = None,
    ) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, options)

    def _output_shards(self) -> dict[ShardId | None, OutputShard]:
        shards: dict[ShardId | None, OutputShard] = {}
        offset = 0
        for i, full in enumerate(self.output_sizes):
            size = divide(full, self.tp.size, "output size")
            shards[i] = OutputShard(offset, size, self.tp.rank * size, full)
            offset += size
        return shards


class QKVParallelLinear(Linear):
    """The fused q/k/v projection (parts "q", "k", "v"), split across ranks by heads. With more
    ranks than KV heads, each KV head is replicated on `tp_size / num_kv_heads` consecutive ranks."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        options: LayerOptions | None = None,
    ) -> None:
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias, options)

    def _output_shards(self) -> dict[ShardId | None, OutputShard]:
        tp = self.tp
        heads = divide(self.num_heads, tp.size, "num_attention_heads")
        if self.num_kv_heads >= tp.size:
            kv_heads = divide(self.num_kv_heads, tp.size, "num_key_value_heads")
            kv_head_start = tp.rank * kv_heads
        else:
            kv_heads = 1
            kv_head_start = tp.rank // divide(
                tp.size, self.num_kv_heads, "tensor-parallel size over KV heads"
            )
        q_size, kv_size = heads * self.head_dim, kv_heads * self.head_dim
        q_full, kv_full = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        kv_start = kv_head_start * self.head_dim
        return {
            "q": OutputShard(0, q_size, tp.rank * q_size, q_full),
            "k": OutputShard(q_size, kv_size, kv_start, kv_full),
            "v": OutputShard(q_size + kv_size, kv_size, kv_start, kv_full),
        }


class RowParallelLinear(Linear):
    """Input features split across ranks: each rank's product is a partial sum, all-reduced over the
    tensor-parallel group (the one all-reduce of an attention or MLP block). The bias is whole on every
    rank and added once, after the reduction."""

    def _input_shard(self) -> tuple[int, int]:
        size = divide(self.input_size, self.tp.size, "input size")
        return self.tp.rank * size, size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.quant_method.apply(self, x, self.bias)
        out = all_reduce_tp(self.quant_method.apply(self, x, None))
        return out if self.bias is None else out + self.bias


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = self._kernel_for(x)
        if kernel is not None:
            return kernel(x, self.weight, self.eps)[0]
        return self._norm(x)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the pre-norm residual stream in one step."""
        kernel = self._kernel_for(x)
        if kernel is not None and residual.is_contiguous():
            return kernel(x, self.weight, self.eps, residual)
        summed = x + residual
        return self._norm(summed), summed

    def _kernel_for(self, x: torch.Tensor) -> Callable[..., Any] | None:
        if use_triton_kernels(x) and x.dim() == 2 and x.is_contiguous():
            from hearth.ops.triton.elementwise import rms_norm

            return rms_norm
        if (
            x.dtype not in (torch.float32, torch.bfloat16)  # bf16: a bf16 model on a bf16 CPU (issue 11)
            or x.device.type != "cpu"
            or x.dim() != 2
            or not x.is_contiguous()
            or self.weight.dtype != x.dtype
        ):
            return None
        return rms_norm_kernel()

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # float32 statistics, as the reference implementations compute them.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, options: LayerOptions | None = None) -> None:
        super().__init__()
        options = options or LayerOptions()
        self.layer_index = layer_index
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            config.head_dim,
            config.num_heads,
            config.num_kv_heads,
            bias=config.attention_bias,
            options=options,
        )
        self.o_proj = RowParallelLinear(config.q_size, config.hidden_size, config.attention_out_bias, options)
        # This rank's heads (all of them on one rank).
        self.num_heads = self.qkv_proj.output_shards["q"].size // config.head_dim
        self.num_kv_heads = self.qkv_proj.output_shards["k"].size // config.head_dim
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * config.head_dim
        self.kv_size = self.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.use_rope = layer_index not in config.no_rope_layers  # NoPE layers (Llama 4's global ones)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        ctx: AttentionContext,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        if not self.use_rope:  # the identity rotation: x * 1 + rotate(x) * 0 is x exactly
            cos, sin = torch.ones_like(cos), torch.zeros_like(sin)
        q, k, v = self._rotate_and_write_kv(self.qkv_proj(hidden), cos, sin, kv, ctx)
        out = ctx.backend.forward(self.layer_index, q, k, v, ctx.kv_pool, ctx.metadata, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.q_size))

    def _rotate_and_write_kv(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        ctx: AttentionContext,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Rotated queries `[tokens, heads, head_dim]` and keys, and the values. On CPU in float32 the
        fused kernel writes keys and values to their pool slots itself and returns (q, None, None)."""
        k_pool, v_pool = kv
        if (
            self.q_norm is None
            and use_triton_kernels(qkv)
            and qkv.is_contiguous()
            and cos.shape[-1] * 2 == self.head_dim  # rotary over the whole head
            and k_pool.dtype in (torch.float32, torch.bfloat16, torch.float16)
        ):
            from hearth.ops.triton.elementwise import rotary_write_kv

            return (
                rotary_write_kv(qkv, cos, sin, self.num_heads, k_pool, v_pool, ctx.metadata.slot_mapping),
                None,
                None,
            )
        if (
            self.q_norm is None
            and qkv.device.type == "cpu"
            and qkv.is_contiguous()
            and qkv.dtype == k_pool.dtype == torch.bfloat16
            and cos.shape[-1] * 2 == self.head_dim
            and (fused := rotary_write_kv_bf16_kernel()) is not None
        ):  # a bf16 model: the torch path's roundings, bit for bit
            slots = ctx.metadata.slot_mapping
            return fused(qkv, cos, sin, self.num_heads, k_pool, v_pool, slots), None, None
        if (
            self.q_norm is None
            and qkv.device.type == "cpu"
            and qkv.is_contiguous()
            and qkv.dtype == torch.float32
        ):
            slots = ctx.metadata.slot_mapping
            if k_pool.dtype == torch.float32 and (fused := rotary_write_kv_kernel()) is not None:
                return fused(qkv, cos, sin, self.num_heads, k_pool, v_pool, slots), None, None
            if is_fp8(k_pool.dtype) and (fused := rotary_write_kv_fp8_kernel()) is not None:
                scales = ctx.kv_pool.kv_scales(self.layer_index)
                assert scales is not None
                return fused(qkv, cos, sin, self.num_heads, k_pool, v_pool, slots, *scales), None, None
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, options: LayerOptions | None = None) -> None:
        super().__init__()
        options = options or LayerOptions()
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [size, size], config.mlp_bias, options
        )
        self.down_proj = RowParallelLinear(size, config.hidden_size, config.mlp_bias, options)
        self.intermediate_size = self.gate_up_proj.output_shards[0].size  # this rank's
        self.act = ACTIVATIONS[config.hidden_act]
        self.is_silu = config.hidden_act == "silu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bf16_rows(x) and self.is_silu and self._quantized_on_one_rank():
            # bf16 prefill math: the intermediate stays bf16 between the two GEMMs (it would be rounded to bf16
            # for the second anyway), which saves two conversions and a float32 SiLU of [rows, intermediate].
            fused = silu_and_mul_bf16_kernel()
            if fused is not None:
                return self.down_proj(fused(self.gate_up_proj(x.to(torch.bfloat16)))).float()
        gate_up = self.gate_up_proj(x)
        if self.is_silu and gate_up.dim() == 2 and use_triton_kernels(gate_up):
            from hearth.ops.triton.elementwise import silu_and_mul

            return self.down_proj(silu_and_mul(gate_up))
        if (
            self.is_silu
            and gate_up.dtype == torch.bfloat16
            and gate_up.device.type == "cpu"
            and gate_up.dim() == 2
            and gate_up.is_contiguous()
            and (fused := silu_and_mul_bf16_kernel()) is not None
        ):  # one pass instead of two and an allocation; the torch path's roundings, bit for bit
            return self.down_proj(fused(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        # In place into the activation's fresh tensor: one [rows, intermediate] allocation and pass fewer
        # (0.86x the time at 64 rows, 0.62x at 512 on 2 AVX2 cores; bit-identical).
        return self.down_proj(self.act(gate).mul_(up))

    def _quantized_on_one_rank(self) -> bool:
        """Both projections INT4/INT8 (whose kernels take bf16 rows on the tiles) and no all-reduce of partial
        sums (which would add them in bf16)."""
        return self.gate_up_proj.tp.size == 1 and all(
            isinstance(getattr(proj, "int4", None) or getattr(proj, "int8", None), (Int4Weights, Int8Weights))
            for proj in (self.gate_up_proj, self.down_proj)
        )


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, options: LayerOptions | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_index, options)
        self.mlp = MLP(config, options)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden, residual, cos, sin, kv, ctx, rows=None):  # type: ignore[no-untyped-def]
        """Pre-norm layer on the residual stream: returns (this layer's output, the stream before it),
        whose sum is the stream after it; the next norm adds them (fused), as the first takes `residual=None`.

        `rows` (an index tensor): only those rows are read after this layer (the model's last layer, whose
        other rows nobody reads). Attention still runs for every row, since it writes every token's KV;
        the norm and the MLP run for `rows` only, and only they are returned."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, kv, ctx)
        if rows is not None:
            hidden, residual = hidden[rows], residual[rows]
            if rows.shape[0] == 0:  # a prefill chunk that samples nothing: only its KV was wanted
                return hidden, residual
        hidden, residual = self.post_attention_layernorm.add_and_norm(hidden, residual)
        return self.mlp(hidden), residual
