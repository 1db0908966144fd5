"""bf16 prefill math for float32 activations (`hearth.ops.prefill_math`): which CPUs and weights take it, that it
holds only inside a forward's scope, the bf16 dequantization kernels against the float32 dequantization, and INT4 /
INT8 linears of prompt-sized row counts on the bf16 tiles (decode-sized ones unchanged)."""

from __future__ import annotations

import pytest
import torch

from hearth.ops import cpu_kernels
from hearth.ops.cpu_capability import CpuCapability, cpu_capability, set_cpu_capability
from hearth.ops.int4 import dequantize_int4, int4_linear, make_int4_weights, quantize_rtn
from hearth.ops.int8 import Int8Weights, dequantize_int8, int8_linear
from hearth.ops.prefill_math import BF16_MIN_ROWS, bf16_rows, prefill_math_scope, resolve_prefill_math

CPU = torch.device("cpu")


def _capability(flags: set[str]) -> CpuCapability:
    return CpuCapability("test CPU", frozenset(flags), "AVX512", onednn_bf16="avx512_bf16" in flags)


@pytest.fixture
def restore_capability():
    yield
    set_cpu_capability(None)


@pytest.mark.parametrize(
    "flags,choice,quantized,activations,expected",
    [
        ({"avx2", "avx512f", "avx512bw", "avx512_bf16"}, "auto", True, torch.float32, "bfloat16"),
        ({"avx2", "avx512f", "avx512bw", "avx512_bf16"}, "auto", False, torch.float32, "float32"),
        ({"avx2", "avx512f", "avx512bw", "avx512_bf16"}, "bfloat16", False, torch.float32, "bfloat16"),
        ({"avx2", "avx512f", "avx512bw", "avx512_bf16"}, "float32", True, torch.float32, "float32"),
        ({"avx2", "avx512f", "avx512bw", "avx512_bf16"}, "auto", True, torch.bfloat16, "float32"),
        ({"avx2"}, "auto", True, torch.float32, "float32"),  # no bf16 math: emulated bf16 would be slower
        ({"avx2"}, "bfloat16", True, torch.float32, "float32"),
    ],
)
def test_resolve_prefill_math(restore_capability, flags, choice, quantized, activations, expected):
    set_cpu_capability(_capability(flags))
    assert cpu_capability().fast_path.has_bf16_math == ("avx512_bf16" in flags)
    assert resolve_prefill_math(choice, quantized=quantized, activations=activations, device=CPU) == expected


def test_prefill_math_is_an_engine_option_with_its_choices():
    from hearth.engine.config import EngineConfig

    assert EngineConfig(model="m").prefill_math == "auto"
    assert EngineConfig(model="m", prefill_math="float32").prefill_math == "float32"
    with pytest.raises(ValueError, match="bfloat16"):
        EngineConfig(model="m", prefill_math="fp8")


def test_bf16_rows_only_inside_the_scope_and_only_for_prompt_sized_float32_operands():
    rows = torch.zeros(BF16_MIN_ROWS, 8)
    assert not bf16_rows(rows)
    with prefill_math_scope("bfloat16"):
        assert bf16_rows(rows)
        assert not bf16_rows(rows[: BF16_MIN_ROWS - 1])  # decode batches keep float32
        assert not bf16_rows(rows.to(torch.bfloat16))  # already bf16 activations: nothing to choose
        with prefill_math_scope("float32"):
            assert not bf16_rows(rows)
        assert bf16_rows(rows)
    assert not bf16_rows(rows)


needs_kernels = pytest.mark.skipif(
    cpu_kernels.paged_decode_attention_kernel(wait=True) is None
    or cpu_kernels.int4_dequantize_bf16_kernel() is None,
    reason="no C++ toolchain for torch extensions",
)


def _int4(out: int, k: int, seed: int = 0):
    weight = torch.randn(out, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    q, scales, zeros = quantize_rtn(weight, 32)
    return make_int4_weights(q, scales, zeros, 32, checkpoint_format=True)


def _int8(out: int, k: int, seed: int = 0) -> Int8Weights:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (out, k), generator=gen, dtype=torch.int8)
    return Int8Weights(q=q, scales=torch.rand(out, k // 32, generator=gen) * 0.01 + 1e-3, group_size=32)


@needs_kernels
def test_bf16_dequantization_is_the_float32_dequantization_rounded():
    weights = _int4(96, 192)
    dense = cpu_kernels.int4_dequantize_bf16_kernel()(  # type: ignore[misc]
        weights.packed, weights.scales, weights.zero_scaled, weights.group_size
    )
    assert dense.dtype == torch.bfloat16 and dense.shape == (96, 192)
    # One rounding to bf16 (the scale-and-shift may be fused): within a bf16 ulp of the float32 values.
    torch.testing.assert_close(dense.float(), dequantize_int4(weights), rtol=2**-8, atol=1e-7)
    int8 = _int8(48, 128)
    dense8 = cpu_kernels.int8_dequantize_bf16_kernel()(int8.q, int8.scales, int8.group_size)  # type: ignore[misc]
    torch.testing.assert_close(dense8.float(), dequantize_int8(int8), rtol=2**-8, atol=1e-7)


@needs_kernels
@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_prompt_rows_run_on_bf16_tiles_and_decode_rows_stay_float32(kind):
    weights = _int4(160, 256) if kind == "int4" else _int8(160, 256)
    linear = int4_linear if kind == "int4" else int8_linear
    dense = (dequantize_int4(weights) if kind == "int4" else dequantize_int8(weights)).double()
    bias = torch.randn(160)
    x = torch.randn(BF16_MIN_ROWS + 66, 256, generator=torch.Generator().manual_seed(1))
    exact = x.double() @ dense.t() + bias.double()
    float32 = linear(x, weights, bias)
    with prefill_math_scope("bfloat16"):
        tiles = linear(x, weights, bias)
        decode = linear(x[:16], weights, bias)
    assert tiles.dtype == torch.float32 and tiles.shape == (x.shape[0], 160)
    torch.testing.assert_close(float32.double(), exact, rtol=1e-4, atol=1e-4)
    # bf16 inputs and a bf16-rounded product: ~3 significant digits overall, and not the float32 path's result.
    assert ((tiles.double() - exact).norm() / exact.norm()).item() < 1e-2
    assert not torch.equal(tiles, float32)
    assert torch.equal(decode, linear(x[:16], weights, bias))  # decode-sized: the float32 kernel, unchanged
