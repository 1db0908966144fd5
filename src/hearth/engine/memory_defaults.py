"""The engine core's allocator settings: for a core process, through its environment (`AsyncEngine`); for an
engine in the caller's process (`LLM`), through glibc's `mallopt` at its construction.

They keep the core's RSS flat under a long mixed load (x1.7-1.8 after warm-up without them).
glibc raises its mmap threshold after each large free until activations of every batch size live in
the heap, fragmented and never returned; a fixed threshold stops that, and two arenas bound the
per-thread heaps OpenMP threads would each grow. The threshold is 64 MiB, not lower: every block
above it is a fresh mmap, page-faulted in and zeroed on each use, and at 1 MiB that was most of a
prefill's activations (a 2,048-token step of the 40M bench model 1.5x slower, served c16 throughput
-20%); with activations bucketed by `row_buckets` the heap's blocks repeat and RSS stays flat.
oneDNN keeps a primitive (JIT code and scratch memory) per matmul shape; `hearth.ops.row_buckets` pads
row counts to a few dozen bucket sizes, so its cache must hold all of them (buckets x the model's
distinct weight shapes, a few hundred): at 64 it thrashed, rebuilding primitives every step, which was
slower and grew RSS (833 -> 1112 MB over 3 passes of 120 shapes, flat at 1024). Each can be overridden
from the environment.
`HEARTH_CORE_MEMORY_DEFAULTS=0` keeps glibc's and oneDNN's own defaults (A/B runs).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping

CORE_MEMORY_ENVIRONMENT = {
    "MALLOC_ARENA_MAX": "2",
    "MALLOC_MMAP_THRESHOLD_": str(64 * 1024 * 1024),
    "MALLOC_TRIM_THRESHOLD_": str(4 * 1024 * 1024),
    "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024",
}

# glibc's mallopt parameters for the environment variables above.
_MALLOPT = {"MALLOC_ARENA_MAX": -8, "MALLOC_MMAP_THRESHOLD_": -3, "MALLOC_TRIM_THRESHOLD_": -1}


def memory_defaults_enabled(env: Mapping[str, str]) -> bool:
    return env.get("HEARTH_CORE_MEMORY_DEFAULTS", "1") != "0"


def apply_in_process() -> None:
    """The settings for this process, where the engine runs in it: each allocator value the environment does not
    set already by `mallopt` (glibc read its variables at start; an in-process prefill otherwise page-faults
    every fresh activation above 128 KiB: silu and mul at 1,500 rows took 4-6x as long), oneDNN's through its
    variable, read when its first primitive is made."""
    if not memory_defaults_enabled(os.environ):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to tune
        libc = None
    for name, value in CORE_MEMORY_ENVIRONMENT.items():
        if name in os.environ:
            continue
        if name in _MALLOPT:
            if libc is not None:
                libc.mallopt(_MALLOPT[name], int(value))
        else:
            os.environ[name] = value
