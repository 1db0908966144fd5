"""Qwen3: the Llama decoder with RMSNorm on each query and key head (qk-norm) before the rotation."""

from __future__ import annotations

from typing import Any

from hearth.model.models.llama import LlamaForCausalLM
from hearth.model.models.qwen2 import qwen_sliding_window


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def config_fields(cls, raw: dict[str, Any], source: str) -> dict[str, Any]:
        return {
            **super().config_fields(raw, source),
            "qk_norm": True,
            **qwen_sliding_window(raw, source),
        }
