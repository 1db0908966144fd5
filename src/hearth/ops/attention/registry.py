"""Attention backends by name, imported only when chosen.

Built in: `cpu` (the torch reference with the compiled CPU decode kernel), `triton` (Triton kernels over
the pool in place) and `torch_ref` (plain torch, any device). A worker takes `select_backend(device)`:
`cpu` on a CPU, `triton` on a GPU when Triton is installed (else `torch_ref`), unless the environment
variable `HEARTH_ATTENTION_BACKEND` names another registered backend. New backends (FP8 or MLA variants)
call `register_backend(name, loader)` with a loader that imports and returns the class.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from hearth.ops.attention.backend import AttentionBackend
from hearth.ops.triton import triton_available

ENV_VAR = "HEARTH_ATTENTION_BACKEND"

_LOADERS: dict[str, Callable[[], type[AttentionBackend]]] = {}


def register_backend(name: str, loader: Callable[[], type[AttentionBackend]]) -> None:
    """`loader()` returns the backend class; it runs (and imports the backend's module) on first use."""
    _LOADERS[name] = loader


def available_backends() -> list[str]:
    return sorted(_LOADERS)


def get_backend(name: str) -> type[AttentionBackend]:
    try:
        loader = _LOADERS[name]
    except KeyError:
        raise ValueError(
            f"unknown attention backend {name!r}; registered: {', '.join(available_backends())}"
        ) from None
    return loader()


def select_backend(device: torch.device | str, override: str | None = None) -> type[AttentionBackend]:
    """`override`, else `$HEARTH_ATTENTION_BACKEND`, else the device's default."""
    return get_backend(override or os.environ.get(ENV_VAR) or _default_backend(torch.device(device)))


def _default_backend(device: torch.device) -> str:
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda" and triton_available():
        return "triton"
    return "torch_ref"


def _cpu() -> type[AttentionBackend]:
    from hearth.ops.attention.cpu import CpuBackend

    return CpuBackend


def _triton() -> type[AttentionBackend]:
    from hearth.ops.attention.triton import TritonBackend

    return TritonBackend


def _torch_ref() -> type[AttentionBackend]:
    from hearth.ops.attention.torch_ref import TorchRefBackend

    return TorchRefBackend


register_backend("cpu", _cpu)
register_backend("torch_ref", _torch_ref)
register_backend("triton", _triton)
