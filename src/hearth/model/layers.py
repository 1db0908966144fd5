"""Building blocks of the decoder families we serve. Parameter names follow Hugging Face's, except the
fused projections (`qkv_proj`, `gate_up_proj`) that the loader fills from the separate checkpoint tensors."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hearth.model.config import ModelConfig
from hearth.model.rotary import apply_rotary
from hearth.ops.attention import AttentionContext
from hearth.ops.cpu_kernels import rms_norm_kernel, rotary_write_kv_kernel
from hearth.ops.linear import LinearWeights, linear, prepare_linear_weights

ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class Linear(nn.Linear):
    """`nn.Linear` that, once prepared, picks a CPU fast path per call (`hearth.ops.linear`).

    Preparing replaces `weight` by the layouts `linear` uses; the float32 weight itself is dropped
    where a prepacked copy serves every row count, so weights are not held twice.
    """

    prepared: LinearWeights | None = None

    def prepare_for_inference(self) -> None:
        self.prepared = prepare_linear_weights(self.weight)
        if self.prepared.fp32 is None:
            self.weight = None  # type: ignore[assignment]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.prepared is None:
            return super().forward(x)
        return linear(x, self.prepared, self.bias)


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
        if (
            x.dtype != torch.float32
            or x.device.type != "cpu"
            or x.dim() != 2
            or not x.is_contiguous()
            or self.weight.dtype != torch.float32
        ):
            return None
        return rms_norm_kernel()

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # float32 statistics, as the reference implementations compute them.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.q_size
        self.kv_size = config.kv_size
        self.scale = config.head_dim**-0.5
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        ctx: AttentionContext,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
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
        fused = rotary_write_kv_kernel() if self.q_norm is None else None
        if (
            fused is not None
            and qkv.device.type == "cpu"
            and qkv.is_contiguous()
            and k_pool.dtype == qkv.dtype == torch.float32
        ):
            return fused(qkv, cos, sin, self.num_heads, k_pool, v_pool, ctx.metadata.slot_mapping), None, None
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
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_index)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden, residual, cos, sin, kv, ctx):  # type: ignore[no-untyped-def]
        """Pre-norm layer on the residual stream: returns (this layer's output, the stream before it),
        whose sum is the stream after it; the next norm adds them (fused), as the first takes `residual=None`."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, kv, ctx)
        hidden, residual = self.post_attention_layernorm.add_and_norm(hidden, residual)
        return self.mlp(hidden), residual
