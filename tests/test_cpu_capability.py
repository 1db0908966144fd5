"""CPU capability detection, the fast path it picks, and the prepacked bf16 linear path (issue 11).

The selection tests run anywhere (the CPU is injected). The numeric tests of the bf16 path need a
oneDNN that runs bf16 (avx512bw/vl/dq or avx_ne_convert): on AVX2-only machines oneDNN refuses to
create bf16 primitives at all, so those tests skip there, and the fallback test checks that such a CPU
still serves bf16 weights (through `F.linear`) even when its cpuinfo were to claim bf16 math.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from hearth.model.layers import ColumnParallelLinear
from hearth.model.quantization.unquantized import UnquantizedLinearMethod
from hearth.ops import linear_bf16
from hearth.ops.cpu_capability import (
    CpuCapability,
    FastPath,
    choose_fast_path,
    detect_cpu_capability,
    onednn_runs_bf16,
    parse_cpuinfo,
    set_cpu_capability,
)
from hearth.ops.linear import linear, prepare_linear_weights

SAPPHIRE_RAPIDS = (
    "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n"
    "flags\t\t: fpu sse2 avx avx2 fma avx512f avx512dq avx512bw avx512vl avx512_bf16 avx512_fp16 "
    "amx_bf16 amx_tile amx_int8\n\nprocessor\t: 1\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n"
)
ZEN4 = "model name\t: AMD EPYC 9654\nflags\t\t: avx avx2 fma avx512f avx512dq avx512bw avx512vl avx512_bf16\n"
ZEN3 = "model name\t: AMD EPYC 7763\nflags\t\t: avx avx2 fma\n"
SKYLAKE = "model name\t: Intel(R) Xeon(R) Gold 6148\nflags\t\t: avx avx2 fma avx512f avx512dq avx512bw\n"


def capability(text: str, torch_capability: str = "AVX512", onednn_bf16: bool = True) -> CpuCapability:
    name, flags = parse_cpuinfo(text)
    return CpuCapability(name, flags, torch_capability, onednn_bf16)


@pytest.fixture
def as_cpu() -> Iterator:
    yield set_cpu_capability
    set_cpu_capability(None)


def test_parse_cpuinfo_reads_the_first_processor() -> None:
    name, flags = parse_cpuinfo(SAPPHIRE_RAPIDS)
    assert name == "Intel(R) Xeon(R) Platinum 8480+"
    assert {"amx_bf16", "amx_tile", "avx512_bf16", "avx2"} <= flags
    assert "avx512_bf1" not in flags  # whole flags, not substrings


@pytest.mark.parametrize(
    ("text", "torch_cap", "onednn_bf16", "expected"),
    [
        (SAPPHIRE_RAPIDS, "AVX512", True, FastPath.AMX_BF16),
        (ZEN4, "AVX512", True, FastPath.AVX512_BF16),
        (SKYLAKE, "AVX512", False, FastPath.AVX512_FP32),
        (ZEN3, "AVX2", False, FastPath.AVX2_FP32),
        # ATEN_CPU_CAPABILITY=avx2 caps torch's kernels: report what torch will actually run.
        (SKYLAKE, "AVX2", False, FastPath.AVX2_FP32),
        # cpuinfo says AMX but this oneDNN cannot run bf16 (an old build): no bf16 path.
        (SAPPHIRE_RAPIDS, "AVX512", False, FastPath.AVX512_FP32),
    ],
)
def test_fast_path_follows_the_flags(
    text: str, torch_cap: str, onednn_bf16: bool, expected: FastPath
) -> None:
    cap = capability(text, torch_cap, onednn_bf16)
    assert cap.fast_path is expected
    assert expected.value in cap.describe() and cap.model_name in cap.describe()


def test_detection_reads_this_machine() -> None:
    cap = detect_cpu_capability()
    assert cap.torch_capability == torch.backends.cpu.get_cpu_capability()
    assert cap.onednn_bf16 == onednn_runs_bf16()
    if "avx512_bf16" not in cap.flags and "amx_bf16" not in cap.flags:
        assert not cap.fast_path.has_bf16_math


def test_bf16_cpu_selects_the_prepacked_path(as_cpu, monkeypatch: pytest.MonkeyPatch) -> None:
    """Given bf16 flags, a bf16 weight is prepacked and every row count goes through the packed branch."""
    as_cpu(capability(SAPPHIRE_RAPIDS))
    reordered: list[torch.Tensor] = []

    def fake_reorder(weight: torch.Tensor) -> torch.Tensor:  # stands in for oneDNN where it has no bf16
        reordered.append(weight)
        return weight.clone()

    monkeypatch.setattr(linear_bf16, "reorder_bf16_weight", fake_reorder)
    weight = torch.randn(48, 32).to(torch.bfloat16)
    prepared = prepare_linear_weights(weight)
    assert len(reordered) == 1 and prepared.fp32 is None and prepared.bf16 is None
    assert prepared.packed is not None
    # The float32 path is untouched by the bf16 flags.
    assert len(reordered) == 1 and prepare_linear_weights(weight.float()).bf16 is not None
    as_cpu(capability(ZEN3, "AVX2", False))
    assert prepare_linear_weights(weight).packed is None


def test_bf16_weights_without_onednn_bf16_fall_back_to_f_linear(as_cpu) -> None:
    """cpuinfo claims bf16 but oneDNN refuses (or really has none): the weight stays and F.linear serves it."""
    as_cpu(capability(SAPPHIRE_RAPIDS))
    weight = torch.randn(48, 32).to(torch.bfloat16)
    if onednn_runs_bf16():
        pytest.skip("this oneDNN runs bf16; the fallback is for CPUs where it does not")
    prepared = prepare_linear_weights(weight)
    assert prepared.packed is None and prepared.fp32 is not None and torch.equal(prepared.fp32, weight)
    x = torch.randn(3, 32).to(torch.bfloat16)
    torch.testing.assert_close(linear(x, prepared, None), torch.nn.functional.linear(x, weight))


needs_onednn_bf16 = pytest.mark.skipif(
    not onednn_runs_bf16(),
    reason="oneDNN on this CPU has no bf16 primitives (needs avx512bw/vl/dq or avx_ne_convert)",
)


@needs_onednn_bf16
@pytest.mark.parametrize("rows", [1, 2, 7, 16, 33, 64, 257, 1000])
@pytest.mark.parametrize("with_bias", [False, True])
def test_prepacked_bf16_linear_matches_float32(rows: int, with_bias: bool, as_cpu) -> None:
    """Every row count (decode through prefill) against a float32 product of the same bf16 values."""
    as_cpu(capability(SAPPHIRE_RAPIDS))
    gen = torch.Generator().manual_seed(rows)
    weight = (torch.randn(1408, 512, generator=gen) * 0.05).to(torch.bfloat16)
    bias = (torch.randn(1408, generator=gen) * 0.1).to(torch.bfloat16) if with_bias else None
    x = torch.randn(rows, 512, generator=gen).to(torch.bfloat16)
    prepared = prepare_linear_weights(weight)
    assert prepared.packed is not None and prepared.fp32 is None
    out = linear(x, prepared, bias)
    expected = x.float() @ weight.float().t() + (bias.float() if bias is not None else 0)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 1408)
    # bf16 products with float32 accumulation, one bf16 rounding of the output (~2^-8 relative).
    torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())
    assert not torch.equal(out, torch.zeros_like(out))


@needs_onednn_bf16
def test_bf16_linear_layer_drops_its_plain_weight_and_matches(as_cpu) -> None:
    """Through the layer and the unquantized method, as a loaded model runs it."""
    as_cpu(capability(SAPPHIRE_RAPIDS))
    torch.manual_seed(0)
    layer = ColumnParallelLinear(256, 384)
    assert isinstance(layer.quant_method, UnquantizedLinearMethod)
    weight = (torch.randn(384, 256) * 0.05).to(torch.bfloat16)
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    layer.quant_method.process_after_loading(layer)
    assert layer.weight is None and layer.prepared is not None and layer.prepared.packed is not None
    for rows in (1, 5, 128):
        x = torch.randn(rows, 256).to(torch.bfloat16)
        expected = x.float() @ weight.float().t()
        torch.testing.assert_close(
            layer(x).float(), expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item()
        )


def test_fast_path_can_be_lowered_for_an_a_b_but_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HEARTH_CPU_FAST_PATH", "avx2-fp32")
    assert capability(SAPPHIRE_RAPIDS).fast_path is FastPath.AVX2_FP32
    monkeypatch.setenv("HEARTH_CPU_FAST_PATH", "amx-bf16")
    assert capability(ZEN3, "AVX2", False).fast_path is FastPath.AVX2_FP32
    monkeypatch.setenv("HEARTH_CPU_FAST_PATH", "amx")
    with pytest.raises(ValueError, match="choose one of avx2-fp32, avx512-fp32, avx512-bf16, amx-bf16"):
        choose_fast_path(capability(ZEN3, "AVX2", False))
