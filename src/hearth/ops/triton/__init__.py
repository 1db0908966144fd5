"""Triton kernels for the GPU path: paged attention, the KV write with RoPE, RMSNorm, SiLU-and-mul, and
the page-tag check. Each has a torch reference it is tested against; on a CPU the tests run them under
the Triton interpreter (`TRITON_INTERPRET=1`), which must be set before this package is imported.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _installed() -> bool:
    return triton_available()


def use_triton_kernels(x: torch.Tensor) -> bool:
    """Whether the model's layers run their Triton kernels on `x`: on a CUDA device when Triton is
    installed, or anywhere with `HEARTH_TRITON_KERNELS=1` (how the tests run them on CPU, interpreted)."""
    return (x.is_cuda or os.environ.get("HEARTH_TRITON_KERNELS") == "1") and _installed()
