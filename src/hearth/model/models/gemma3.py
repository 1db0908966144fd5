"""Gemma 3 (text: `Gemma3ForCausalLM`): sliding-window layers and full layers interleaved (`layer_types`),
each kind with its own rotary base (`rope_local_base_freq` / the sliding layers' `rope_parameters`), RMSNorm
with `1 + weight` computed in float32, a norm after attention and after the MLP as well as before them,
q/k norms, the embedding scaled by sqrt(hidden_size), attention scaled by `query_pre_attn_scalar`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from hearth.model.config import ModelConfig, ModelLoadError
from hearth.model.decoder import CausalLM
from hearth.model.layers import MLP, Attention, LayerOptions, RMSNorm
from hearth.model.rotary import build_cos_sin_table


class GemmaRMSNorm(RMSNorm):
    """`norm(x) * (1 + weight)`, all in float32, then cast: Gemma's norm (its weights are stored as offsets)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        summed = x + residual
        return self.forward(summed), summed


class Gemma3DecoderLayer(torch.nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, options: LayerOptions | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_index, options)
        self.self_attn.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)
        self.self_attn.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)
        if config.query_pre_attn_scalar is not None:
            self.self_attn.scale = config.query_pre_attn_scalar**-0.5
        self.is_sliding = config.layer_attention(layer_index)[0] is not None
        self.mlp = MLP(config, options)
        eps = config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(self, hidden, residual, cos, sin, kv, ctx, rows=None):  # type: ignore[no-untyped-def]
        """Returns (the residual stream after this layer, None): the norms after attention and the MLP sit
        inside the residual branch, so there is no sum to fuse into the next layer's norm."""
        if residual is not None:
            hidden = hidden + residual
        # The table holds both schedules: global then local halves of cos and of sin (`rotary_table`).
        half = cos.shape[-1] // 2
        part = slice(half, None) if self.is_sliding else slice(None, half)
        attn = self.self_attn(self.input_layernorm(hidden), cos[..., part], sin[..., part], kv, ctx)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp), None


class Gemma3ForCausalLM(CausalLM):
    layer_class = Gemma3DecoderLayer

    @classmethod
    def config_fields(cls, raw: dict[str, Any], source: str) -> dict[str, Any]:
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if raw.get(key) is not None:
                raise ModelLoadError(f"{source}: {key} is not supported")
        num_layers = int(raw.get("num_hidden_layers") or 0)
        layer_types = raw.get("layer_types") or [
            "full_attention"
            if (i + 1) % int(raw.get("sliding_window_pattern", 6)) == 0
            else "sliding_attention"
            for i in range(num_layers)
        ]
        if len(layer_types) != num_layers or not set(layer_types) <= {"sliding_attention", "full_attention"}:
            raise ModelLoadError(
                f"{source}: layer_types must name full_attention or sliding_attention per layer"
            )
        rope = raw.get("rope_parameters") or {}
        local = rope.get("sliding_attention") if isinstance(rope.get("sliding_attention"), dict) else {}
        local_theta = local.get("rope_theta") or raw.get("rope_local_base_freq") or 10000.0
        return {
            "attention_bias": bool(raw.get("attention_bias", False)),
            "attention_out_bias": bool(raw.get("attention_bias", False)),
            "qk_norm": True,
            "sliding_window": int(raw.get("sliding_window") or 4096),
            "layer_types": tuple(layer_types),
            "rope_local_theta": float(local_theta),
            "query_pre_attn_scalar": float(raw.get("query_pre_attn_scalar") or raw.get("head_dim") or 256),
        }

    def __init__(self, config: ModelConfig, max_positions: int, options: LayerOptions | None = None) -> None:
        super().__init__(config, max_positions, options)
        self.embed_scale = config.hidden_size**0.5
        if self.model.is_last_stage:
            self.model.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    @classmethod
    def rotary_table(cls, config: ModelConfig, max_positions: int) -> torch.Tensor:
        """`[cos global | cos local | sin global | sin local]`: `forward` halves it into cos and sin, each
        Gemma layer takes its kind's half of those."""
        local = dataclasses.replace(
            config,
            rope_theta=config.rope_local_theta or config.rope_theta,
            rope_scaling={"rope_type": "default"},
        )
        cos_g, sin_g = build_cos_sin_table(config, max_positions).chunk(2, dim=-1)
        cos_l, sin_l = build_cos_sin_table(local, max_positions).chunk(2, dim=-1)
        return torch.cat([cos_g, cos_l, sin_g, sin_l], dim=-1)
