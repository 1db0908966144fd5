"""Mistral: the Llama decoder without biases, attending over a sliding window when the config sets one."""

from __future__ import annotations

from typing import Any

from hearth.model.decoder import CausalLM


class MistralForCausalLM(CausalLM):
    @classmethod
    def config_fields(cls, raw: dict[str, Any], source: str) -> dict[str, Any]:
        window = raw.get("sliding_window")
        return {"sliding_window": int(window) if window else None}
