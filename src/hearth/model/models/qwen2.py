"""Qwen2 / Qwen2.5: the Llama decoder with a bias on q/k/v (always) and an opt-in sliding window."""

from __future__ import annotations

from typing import Any

from hearth.model.config import ModelLoadError
from hearth.model.decoder import CausalLM


def qwen_sliding_window(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """The window and the layers that use it, read as transformers' Qwen configs do: none unless
    `use_sliding_window`, then on the layers from `max_window_layers` on (or as `layer_types` says)."""
    window = raw.get("sliding_window")
    if not raw.get("use_sliding_window", False) or not window:
        return {"sliding_window": None}
    num_layers = int(raw.get("num_hidden_layers") or 0)
    first_windowed = int(raw.get("max_window_layers", 28))  # transformers' default
    layer_types = raw.get("layer_types") or [
        "sliding_attention" if i >= first_windowed else "full_attention" for i in range(num_layers)
    ]
    if len(layer_types) != num_layers or not set(layer_types) <= {"sliding_attention", "full_attention"}:
        raise ModelLoadError(f"{source}: layer_types must name full_attention or sliding_attention per layer")
    if all(kind == "full_attention" for kind in layer_types):
        return {"sliding_window": None}
    if all(kind == "sliding_attention" for kind in layer_types):
        return {"sliding_window": int(window)}
    return {"sliding_window": int(window), "layer_types": tuple(layer_types)}


class Qwen2ForCausalLM(CausalLM):
    @classmethod
    def config_fields(cls, raw: dict[str, Any], source: str) -> dict[str, Any]:
        return {"attention_bias": True, **qwen_sliding_window(raw, source)}
