"""Attention backends by name, imported only when chosen.

Built in: `cpu` (the torch reference with the compiled CPU decode kernel), `triton` (Triton kernels over
the pool in place) and `torch_ref` (plain torch, any device). A worker takes `select_backend(device)`:
`cpu` on a CPU, `triton` on a GPU when Triton is installed (else `torch_ref`), unless the environment
variable `HEARTH_ATTENTION_BACKEND` names another registered backend. New backends (FP8 or MLA variants)
are one more `"module:Class"` line in `ATTENTION_BACKENDS` (or `register_backend(name, target)` from outside).
"""

from __future__ import annotations

import os

import torch

from hearth.contracts.registry import Registry
from hearth.ops.attention.backend import AttentionBackend
from hearth.ops.triton import triton_available

ENV_VAR = "HEARTH_ATTENTION_BACKEND"

ATTENTION_BACKENDS: Registry[type[AttentionBackend]] = Registry("attention backend")
ATTENTION_BACKENDS.add("cpu", "hearth.ops.attention.cpu:CpuBackend")
ATTENTION_BACKENDS.add("torch_ref", "hearth.ops.attention.torch_ref:TorchRefBackend")
ATTENTION_BACKENDS.add("triton", "hearth.ops.attention.triton:TritonBackend")


def register_backend(name: str, target: type[AttentionBackend] | str) -> None:
    """`target`: the backend class, or `"module:Class"` to import on first use."""
    ATTENTION_BACKENDS.add(name, target)


def available_backends() -> list[str]:
    return list(ATTENTION_BACKENDS.names())


def get_backend(name: str) -> type[AttentionBackend]:
    """The backend class registered as `name`; an UnknownNameError naming the registered ones otherwise."""
    return ATTENTION_BACKENDS.get(name)


def select_backend(device: torch.device | str, override: str | None = None) -> type[AttentionBackend]:
    """`override`, else `$HEARTH_ATTENTION_BACKEND`, else the device's default."""
    return get_backend(override or os.environ.get(ENV_VAR) or _default_backend(torch.device(device)))


def _default_backend(device: torch.device) -> str:
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda" and triton_available():
        return "triton"
    return "torch_ref"
