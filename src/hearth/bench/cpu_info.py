"""The CPU a benchmark ran on, as `lscpu` names it, and the vector flags that decide CPU kernel speed.

Benchmarks print this beside their figures so that numbers from different machines are not compared
by mistake. `lscpu` is preferred (it is what a reader would type); /proc/cpuinfo stands in without it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

from hearth.ops.cpu_capability import parse_cpuinfo

# The flags that matter for dense and quantized CPU kernels, in the order they are printed.
KERNEL_FLAGS = (
    "avx2",
    "avx512f",
    "avx512_vnni",
    "avx512_bf16",
    "avx_vnni",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)


@dataclass(frozen=True)
class CpuInfo:
    model_name: str
    flags: frozenset[str]
    num_cpus: int

    @property
    def kernel_flags(self) -> list[str]:
        return [flag for flag in KERNEL_FLAGS if flag in self.flags]

    def describe(self) -> str:
        return (
            f"CPU: {self.model_name} ({self.num_cpus} CPUs); flags: {' '.join(self.kernel_flags) or 'none'}"
        )

    def to_json(self) -> dict[str, object]:
        return {"model_name": self.model_name, "num_cpus": self.num_cpus, "flags": self.kernel_flags}


def parse_lscpu(text: str) -> CpuInfo:
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in fields:
            fields[key.strip()] = value.strip()
    num_cpus = fields.get("CPU(s)", "0")
    return CpuInfo(
        model_name=fields.get("Model name", "unknown"),
        flags=frozenset(fields.get("Flags", "").split()),
        num_cpus=int(num_cpus) if num_cpus.isdigit() else 0,
    )


def cpu_info() -> CpuInfo:
    lscpu = shutil.which("lscpu")
    if lscpu:
        # LC_ALL=C: lscpu translates its field names.
        done = subprocess.run(
            [lscpu], capture_output=True, text=True, check=False, env=dict(os.environ, LC_ALL="C")
        )
        if done.returncode == 0:
            info = parse_lscpu(done.stdout)
            if info.model_name != "unknown":
                return info
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        text = ""
    model_name, flags = parse_cpuinfo(text)
    return CpuInfo(
        model_name=model_name, flags=flags, num_cpus=text.count("\nprocessor") + text.startswith("processor")
    )
