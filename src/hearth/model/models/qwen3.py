"""Qwen3: the Llama decoder with RMSNorm on each query and key head (qk-norm) before the rotation."""

from __future__ import annotations

from typing import Any

from hearth.model.decoder import CausalLM
from hearth.model.models.qwen2 import qwen_sliding_window
from hearth.model.registry import register_model


@register_model("Qwen3ForCausalLM")
class Qwen3ForCausalLM(CausalLM):
    @classmethod
    def config_fields(cls, raw: dict[str, Any], source: str) -> dict[str, Any]:
        attention_bias = bool(raw.get("attention_bias", False))
        return {
            "attention_bias": attention_bias,
            "attention_out_bias": attention_bias,
            "qk_norm": True,
            "sliding_window": qwen_sliding_window(raw, source),
        }
