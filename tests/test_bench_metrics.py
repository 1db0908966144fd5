"""Run summaries (vLLM field names), SLO parsing and goodput, Markdown and compare ratios."""

from __future__ import annotations

import pytest

from hearth.bench.client import RequestResult
from hearth.bench.compare import compare_table, ratio_cell
from hearth.bench.metrics import Slo, parse_slos, summarize
from hearth.bench.report import run_markdown


def _result(ttft_s: float, itls_s: list[float], prompt: int, cached: int, **kw) -> RequestResult:
    return RequestResult(
        success=True, ttft_s=ttft_s, itl_s=itls_s, e2el_s=ttft_s + sum(itls_s), prompt_tokens=prompt,
        cached_tokens=cached, completion_tokens=len(itls_s) + 1, usage_reported=True, **kw,
    )  # fmt: skip


def test_parse_slos_with_units():
    assert parse_slos("ttft=500ms, tpot=50, e2el=2s") == [
        Slo("ttft", 500.0),
        Slo("tpot", 50.0),
        Slo("e2el", 2000.0),
    ]
    with pytest.raises(ValueError, match="NAME=VALUE"):
        parse_slos("latency=5ms")
    with pytest.raises(ValueError, match="bad SLO value"):
        parse_slos("ttft=fast")


def test_summary_figures_and_goodput():
    results = [
        _result(0.1, [0.01, 0.01, 0.01], prompt=100, cached=0),  # tpot 10 ms
        _result(0.3, [0.05, 0.05], prompt=100, cached=80),  # tpot 50 ms
        RequestResult(success=False, error="HTTP 503: overloaded"),
    ]
    s = summarize(results, duration_s=2.0, slos=parse_slos("ttft=200ms,tpot=20ms"))
    assert (s["completed"], s["failed"]) == (2, 1)
    assert (s["total_input_tokens"], s["total_output_tokens"], s["total_cached_tokens"]) == (200, 7, 80)
    assert s["cache_hit_ratio"] == pytest.approx(0.4)
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(3.5)
    assert s["request_goodput"] == pytest.approx(0.5)  # only the first meets both SLOs
    assert s["mean_ttft_ms"] == pytest.approx(200.0)
    assert s["median_tpot_ms"] == pytest.approx(30.0)
    assert s["p99_itl_ms"] == pytest.approx(50.0)
    assert s["mean_e2el_ms"] == pytest.approx((130 + 400) / 2)
    assert s["error_counts"] == {"HTTP 503": 1}
    assert s["errors"] == ["", "", "HTTP 503: overloaded"]
    assert s["itls"][1] == [0.05, 0.05]


def test_empty_run_summarizes_without_crashing():
    s = summarize([], duration_s=0.0)
    assert s["completed"] == 0 and s["mean_ttft_ms"] == 0.0 and s["cache_hit_ratio"] == 0.0


def test_markdown_has_latency_rows_and_interrupted_flag():
    s = summarize([_result(0.1, [0.01], prompt=10, cached=5)], duration_s=1.0)
    s.update(label="x", load="c1", interrupted=True, max_concurrent_requests=1, client_cpu_util=0.1)
    text = run_markdown(s, (50.0, 90.0, 99.0))
    assert "Interrupted" in text and "| TTFT | 100.00 |" in text and "50.0%" in text


def test_compare_ratios_mark_the_better_side():
    assert ratio_cell(100.0, 150.0, higher_is_better=True) == "1.50x (better)"
    assert ratio_cell(100.0, 150.0, higher_is_better=False) == "1.50x"
    assert ratio_cell(0, 1.0, True) == "–"
    a = [{"max_concurrency": 1, "output_throughput": 10.0}, {"max_concurrency": 8, "output_throughput": 40.0}]
    b = [{"max_concurrency": 8, "output_throughput": 80.0}]
    table = compare_table(a, b, "max_concurrency", (("output_throughput", True),), ("A", "B"))
    assert "| 8 | output_throughput | 40.0 | 80.0 | 2.00x (better) |" in table
    assert "| 1 |" not in table
