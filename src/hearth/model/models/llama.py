"""Llama (and the many checkpoints that reuse its architecture name)."""

from __future__ import annotations

from typing import Any

from hearth.model.decoder import CausalLM


class LlamaForCausalLM(CausalLM):
    """The base decoder. `attention_bias` puts a bias on q/k/v and o_proj, `mlp_bias` on the MLP; no
    sliding window."""

    @classmethod
    def config_fields(cls, raw: dict[str, Any], source: str) -> dict[str, Any]:
        attention_bias = bool(raw.get("attention_bias", False))
        return {
            "attention_bias": attention_bias,
            "attention_out_bias": attention_bias,
            "mlp_bias": bool(raw.get("mlp_bias", False)),
        }
