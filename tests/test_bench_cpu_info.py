"""`lscpu` output becomes the CPU line benchmarks print: model name, CPU count and the kernel flags only."""

from __future__ import annotations

from hearth.bench.cpu_info import cpu_info, parse_lscpu

LSCPU = """\
Architecture:                            x86_64
CPU(s):                                  2
Model name:                              AMD EPYC
Flags:                                   fpu sse2 avx2 avx512f avx512_bf16 amx_tile sha_ni
NUMA node0 CPU(s):                       0,1
"""


def test_lscpu_model_count_and_kernel_flags_in_fixed_order() -> None:
    info = parse_lscpu(LSCPU)
    assert info.model_name == "AMD EPYC"
    assert info.num_cpus == 2  # the first "CPU(s)", not the NUMA node's
    assert info.kernel_flags == ["avx2", "avx512f", "avx512_bf16", "amx_tile"]
    assert info.describe() == "CPU: AMD EPYC (2 CPUs); flags: avx2 avx512f avx512_bf16 amx_tile"


def test_missing_fields_read_as_unknown_and_none() -> None:
    info = parse_lscpu("Architecture: x86_64\n")
    assert info.model_name == "unknown" and info.num_cpus == 0 and info.kernel_flags == []
    assert info.describe().endswith("flags: none")


def test_this_machine_is_described() -> None:
    info = cpu_info()
    assert info.model_name and info.model_name != "unknown"
    assert info.num_cpus >= 1
