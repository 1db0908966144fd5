"""Model architectures by their Hugging Face `architectures` name (config.json).

Each family is one module in `hearth.model.models`; a new family (MoE, MLA) is a new module there plus one
line in `MODELS` below. Entries are lazy `"module:Class"` strings, so importing this registry (the model
config does, to check a checkpoint's architecture) imports neither torch nor any model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from hearth.contracts.registry import Registry

if TYPE_CHECKING:
    from hearth.model.decoder import CausalLM

MODELS: Registry[type[CausalLM]] = Registry("model architecture")
MODELS.add("LlamaForCausalLM", "hearth.model.models.llama:LlamaForCausalLM")
MODELS.add("MistralForCausalLM", "hearth.model.models.mistral:MistralForCausalLM")
MODELS.add("Qwen2ForCausalLM", "hearth.model.models.qwen2:Qwen2ForCausalLM")
MODELS.add("Qwen3ForCausalLM", "hearth.model.models.qwen3:Qwen3ForCausalLM")
MODELS.add("Qwen3MoeForCausalLM", "hearth.model.models.qwen3_moe:Qwen3MoeForCausalLM")
MODELS.add("DeepseekV3ForCausalLM", "hearth.model.models.deepseek_v3:DeepseekV3ForCausalLM")
MODELS.add("Glm4MoeForCausalLM", "hearth.model.models.glm4_moe:Glm4MoeForCausalLM")
MODELS.add("Gemma3ForCausalLM", "hearth.model.models.gemma3:Gemma3ForCausalLM")

C = TypeVar("C", bound="type[CausalLM]")


def register_model(*architectures: str) -> Callable[[C], C]:
    """Class decorator for a family defined outside this package: serve checkpoints whose config.json
    names one of `architectures` (the first is its name, the rest aliases)."""

    def register(cls: C) -> C:
        MODELS.add(architectures[0], cls, aliases=architectures[1:])
        return cls

    return register


def supported_architectures() -> tuple[str, ...]:
    return MODELS.choices()


def get_model_class(architecture: str) -> type[CausalLM]:
    """The class serving `architecture`; an UnknownNameError naming the supported ones otherwise."""
    return MODELS.get(architecture)
