"""The side-by-side script's decisions: vLLM's dtype for a CPU, and the goal rows' ratios and verdicts."""

from __future__ import annotations

from hearth.bench.side_by_side import GOAL_ROWS, format_table, goal_table, vllm_best_dtype
from hearth.ops.cpu_capability import CpuCapability


def cap(*flags: str) -> CpuCapability:
    return CpuCapability("test CPU", frozenset(flags), "AVX512", True)


def test_vllm_dtype_is_bf16_only_with_bf16_math() -> None:
    assert vllm_best_dtype(cap("avx2", "avx512f", "avx512_bf16")) == "bfloat16"
    assert vllm_best_dtype(cap("avx2", "amx_bf16", "amx_tile")) == "bfloat16"
    assert vllm_best_dtype(cap("avx2", "avx512f")) == "float32"
    assert vllm_best_dtype(cap("avx2")) == "float32"


def test_goal_rows_take_medians_and_judge_each_direction() -> None:
    hearth = {
        "offline_bs64_tok_s": [700.0, 800.0, 760.0],  # median 760 vs 500: 1.52x, met
        "offline_bs1_tok_s": [100.0],  # 100 vs 80: 1.25x, not met
        "c16_ttft_p90_ms": [300.0],  # 300 vs 600: 0.5x, met (lower is better)
        "c1_itl_p50_ms": [9.0],  # 9 vs 10: 0.9x, not met
    }
    vllm = {
        "offline_bs64_tok_s": [500.0, 500.0, 500.0],
        "offline_bs1_tok_s": [80.0],
        "c16_ttft_p90_ms": [600.0],
        "c1_itl_p50_ms": [10.0],
    }
    rows = {row["row"]: row for row in goal_table(hearth, vllm)}
    assert len(rows) == len(GOAL_ROWS)
    assert (
        rows["offline batch 64, output tok/s"]["ratio"] == 1.52
        and rows["offline batch 64, output tok/s"]["met"]
    )
    assert rows["offline batch 1, output tok/s"]["met"] is False
    assert rows["serve c16 TTFT p90, ms"]["ratio"] == 0.5 and rows["serve c16 TTFT p90, ms"]["met"] is True
    assert rows["serve c1 ITL p50, ms"]["met"] is False
    assert rows["serve c16 output tok/s"]["ratio"] is None  # not measured: no verdict
    table = format_table(list(rows.values()), cap("avx2"), "float32")
    assert (
        "test CPU" in table
        and "avx2" in table
        and "| offline batch 64, output tok/s | 760.0 | 500.0 | 1.52x" in table
    )
