"""Model architectures by their Hugging Face `architectures` name (config.json).

Each family is one module in `hearth.model.models` whose class registers the names it serves with
`@register_model("XForCausalLM")`; a new family (MoE, MLA) is a new module there plus its name in
`_MODULES`. Modules are imported on first lookup, so importing the registry stays cheap.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from hearth.model.config import ModelLoadError

if TYPE_CHECKING:
    from hearth.model.decoder import CausalLM

_MODULES = (
    "hearth.model.models.llama",
    "hearth.model.models.mistral",
    "hearth.model.models.qwen2",
    "hearth.model.models.qwen3",
    "hearth.model.models.qwen3_moe",
    "hearth.model.models.deepseek_v3",
    "hearth.model.models.glm4_moe",
    "hearth.model.models.gemma3",
)
_MODELS: dict[str, type[CausalLM]] = {}

C = TypeVar("C", bound="type[CausalLM]")


def register_model(*architectures: str) -> Callable[[C], C]:
    """Class decorator: serve checkpoints whose config.json names one of `architectures`."""

    def register(cls: C) -> C:
        for name in architectures:
            if name in _MODELS and _MODELS[name] is not cls:
                raise ValueError(f"architecture {name!r} is already served by {_MODELS[name].__name__}")
            _MODELS[name] = cls
        return cls

    return register


def _ensure_registered() -> None:
    for module in _MODULES:
        importlib.import_module(module)


def supported_architectures() -> tuple[str, ...]:
    _ensure_registered()
    return tuple(sorted(_MODELS))


def get_model_class(architecture: str) -> type[CausalLM]:
    """The class serving `architecture`; a ModelLoadError naming the supported ones otherwise."""
    _ensure_registered()
    cls = _MODELS.get(architecture)
    if cls is None:
        raise ModelLoadError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(supported_architectures())}"
        )
    return cls
