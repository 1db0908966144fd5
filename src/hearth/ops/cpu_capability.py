"""What this CPU can do, detected once per process, and the fast path Hearth takes on it.

CPUs Hearth meets differ in the one thing that decides the dense-linear path: native bf16 math.

- **AVX2 only** (Zen 2/3, older Xeons): bf16 matmuls are emulated (~10x slower), so compute is float32
  with oneDNN-prepacked weights and the bf16-weight skinny kernel for few rows (`hearth.ops.linear`).
- **AVX-512 without bf16** (Skylake/Cascade Lake): the same float32 path; torch and oneDNN pick their
  AVX-512 kernels by themselves, so there is nothing of ours to switch.
- **AVX512-BF16** (Zen 4, Cooper Lake) and **AMX bf16** (Sapphire Rapids and later): bf16 checkpoints
  compute in bf16 and every linear runs through a oneDNN-prepacked bf16 weight
  (`hearth.ops.linear_bf16`), which oneDNN executes on AMX tiles where present.

`torch.backends.cpu.get_cpu_capability()` names the widest vector ISA torch's own kernels dispatch to
(it can be capped with ATEN_CPU_CAPABILITY); `/proc/cpuinfo` flags say whether bf16 units exist at all.
"""

from __future__ import annotations

import enum
import functools
import logging
import os
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

# The flags that decide the fast path, in the order they are logged.
WATCHED_FLAGS = ("avx2", "avx512f", "avx512bw", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16")


class FastPath(enum.Enum):
    AVX2_FP32 = "avx2-fp32"
    AVX512_FP32 = "avx512-fp32"
    AVX512_BF16 = "avx512-bf16"
    AMX_BF16 = "amx-bf16"

    @property
    def has_bf16_math(self) -> bool:
        return self in (FastPath.AVX512_BF16, FastPath.AMX_BF16)


@dataclass(frozen=True)
class CpuCapability:
    model_name: str
    flags: frozenset[str]
    torch_capability: str  # torch.backends.cpu.get_cpu_capability(): "AVX2", "AVX512", "DEFAULT", ...
    onednn_bf16: bool  # whether this torch's oneDNN will run bf16 primitives at all

    @property
    def fast_path(self) -> FastPath:
        return choose_fast_path(self)

    def describe(self) -> str:
        watched = " ".join(flag for flag in WATCHED_FLAGS if flag in self.flags) or "none"
        return (
            f"CPU {self.model_name!r}: flags {watched}; torch kernels {self.torch_capability}; "
            f"oneDNN bf16 {'yes' if self.onednn_bf16 else 'no'}; fast path {self.fast_path.value}"
        )


# A/B switch: HEARTH_CPU_FAST_PATH=avx2-fp32 (or avx512-fp32, ...) takes that path if the CPU has it.
FAST_PATH_ENV = "HEARTH_CPU_FAST_PATH"


def choose_fast_path(cap: CpuCapability) -> FastPath:
    """bf16 needs both the hardware (cpuinfo) and a oneDNN that will run bf16 primitives on it; AMX
    is named separately because it is a different order of speed (tiles vs AVX512-BF16 dot products)."""
    best = _best_fast_path(cap)
    forced = os.environ.get(FAST_PATH_ENV)
    if forced:
        order = list(FastPath)
        try:
            wanted = FastPath(forced)
        except ValueError:
            choices = ", ".join(path.value for path in FastPath)
            raise ValueError(f"{FAST_PATH_ENV}={forced!r}: choose one of {choices}") from None
        return wanted if order.index(wanted) <= order.index(best) else best
    return best


def _best_fast_path(cap: CpuCapability) -> FastPath:
    if cap.onednn_bf16 and "amx_bf16" in cap.flags and "amx_tile" in cap.flags:
        return FastPath.AMX_BF16
    if cap.onednn_bf16 and "avx512_bf16" in cap.flags:
        return FastPath.AVX512_BF16
    if "avx512f" in cap.flags and cap.torch_capability.startswith("AVX512"):
        return FastPath.AVX512_FP32
    return FastPath.AVX2_FP32


def parse_cpuinfo(text: str) -> tuple[str, frozenset[str]]:
    """(model name, flags) of the first processor in a /proc/cpuinfo text; every core reports the same."""
    model_name = "unknown"
    flags: frozenset[str] = frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model_name == "unknown":
            model_name = value.strip()
        elif key in ("flags", "Features") and not flags:  # "Features" on aarch64
            flags = frozenset(value.split())
        if model_name != "unknown" and flags:
            break
    return model_name, flags


def onednn_runs_bf16() -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch build without the query
        return False


def detect_cpu_capability(cpuinfo_text: str | None = None) -> CpuCapability:
    if cpuinfo_text is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo_text = f.read()
        except OSError:
            cpuinfo_text = ""
    model_name, flags = parse_cpuinfo(cpuinfo_text)
    return CpuCapability(
        model_name=model_name,
        flags=flags,
        torch_capability=torch.backends.cpu.get_cpu_capability(),
        onednn_bf16=onednn_runs_bf16(),
    )


_override: CpuCapability | None = None


@functools.cache
def _detected() -> CpuCapability:
    return detect_cpu_capability()


def cpu_capability() -> CpuCapability:
    """This process's CPU, detected once (or the capability a test set with `set_cpu_capability`)."""
    return _override if _override is not None else _detected()


def set_cpu_capability(cap: CpuCapability | None) -> None:
    """Pretend to be another CPU (tests of the selection logic); None goes back to detection."""
    global _override
    _override = cap


_logged = False


def log_cpu_capability() -> CpuCapability:
    """Log the CPU and its fast path once per process (engine start); returns the capability."""
    global _logged
    cap = cpu_capability()
    if not _logged:
        logger.info("%s", cap.describe())
        _logged = True
    return cap
