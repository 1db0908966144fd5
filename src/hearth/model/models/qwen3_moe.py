"""Qwen3-MoE: Qwen3's attention (qk-norm) with a sparse MoE block (softmax top-k routing) in every layer
but the `mlp_only_layers` and those `decoder_sparse_step` skips."""

from __future__ import annotations

from typing import Any

from hearth.model.config import MoEConfig
from hearth.model.models.qwen2 import qwen_sliding_window
from hearth.model.moe import MoECausalLM


class Qwen3MoeForCausalLM(MoECausalLM):
    @classmethod
    def config_fields(cls, raw: dict[str, Any], source: str) -> dict[str, Any]:
        num_layers = int(raw.get("num_hidden_layers") or 0)
        # transformers 5 writes `num_local_experts`; the published checkpoints say `num_experts`.
        num_experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
        step = int(raw.get("decoder_sparse_step") or 1)
        mlp_only = set(raw.get("mlp_only_layers") or [])
        dense = frozenset(
            i for i in range(num_layers) if i in mlp_only or not (num_experts > 0 and (i + 1) % step == 0)
        )
        attention_bias = bool(raw.get("attention_bias", False))
        return {
            "attention_bias": attention_bias,
            "attention_out_bias": attention_bias,
            "qk_norm": True,
            **qwen_sliding_window(raw, source),
            "moe": MoEConfig(
                num_experts=num_experts,
                top_k=int(raw.get("num_experts_per_tok") or 1),
                intermediate_size=int(raw.get("moe_intermediate_size") or 0),
                norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
                scoring="softmax",
                dense_layers=dense,
            ),
        }
