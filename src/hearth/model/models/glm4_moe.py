"""GLM-4.5 / GLM-4.6 (`Glm4MoeForCausalLM`): grouped-query attention with a bias on q/k/v (not on the
output), rotary embedding on the first `partial_rotary_factor` of each head's dims, optional qk-norm; the
MoE of DeepSeek-V3 (sigmoid grouped routing with a correction bias, shared experts, the first
`first_k_dense_replace` layers dense)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from hearth.model.config import ModelConfig
from hearth.model.layers import Attention, LayerOptions
from hearth.model.moe import MoECausalLM, MoEDecoderLayer, sigmoid_moe_config
from hearth.model.rotary import apply_rotary
from hearth.ops.attention import AttentionContext


class PartialRotaryAttention(Attention):
    """Attention whose rotary embedding turns only the first `config.rotary_size` dims of each head."""

    def __init__(self, config: ModelConfig, layer_index: int, options: LayerOptions | None = None) -> None:
        super().__init__(config, layer_index, options)
        self.rotary_size = config.rotary_size

    def _rotate_and_write_kv(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        ctx: AttentionContext,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        if self.rotary_size == self.head_dim:
            return super()._rotate_and_write_kv(qkv, cos, sin, kv, ctx)
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        return self._rotate_part(q, cos, sin), self._rotate_part(k, cos, sin), v

    def _rotate_part(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rotated, passed = x.split([self.rotary_size, self.head_dim - self.rotary_size], dim=-1)
        return torch.cat((apply_rotary(rotated, cos, sin), passed), dim=-1)


class Glm4MoeDecoderLayer(MoEDecoderLayer):
    attention_class: ClassVar[type[nn.Module]] = PartialRotaryAttention


class Glm4MoeForCausalLM(MoECausalLM):
    layer_class: ClassVar[type[nn.Module]] = Glm4MoeDecoderLayer

    @classmethod
    def config_fields(cls, raw: dict[str, Any], source: str) -> dict[str, Any]:
        num_layers = int(raw.get("num_hidden_layers") or 0)
        num_heads = int(raw.get("num_attention_heads") or 1)
        head_dim = int(raw.get("head_dim") or int(raw.get("hidden_size") or 0) // num_heads)
        # transformers 5 keeps the factor in `rope_parameters`; GLM-4.5's own config.json has it at the top.
        factor = (raw.get("rope_parameters") or {}).get("partial_rotary_factor") or raw.get(
            "partial_rotary_factor", 0.5
        )
        return {
            "attention_bias": bool(raw.get("attention_bias", False)),
            "attention_out_bias": False,
            "qk_norm": bool(raw.get("use_qk_norm", False)),
            "rotary_dim": int(head_dim * float(factor)),
            "moe": sigmoid_moe_config(raw, source, num_layers),
        }
