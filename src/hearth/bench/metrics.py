"""Aggregate per-request results into one run's summary, with vLLM's bench field names.

Latencies are reported in milliseconds as `mean_/median_/std_/pXX_{ttft,tpot,itl,e2el}_ms`; the
per-request arrays (`ttfts`, `itls`, ...) stay in seconds, as vLLM writes them.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass

import numpy as np

from hearth.bench.client import RequestResult

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)
_SLO_METRICS = ("ttft", "tpot", "e2el")
_UNIT_TO_MS = {"ms": 1.0, "s": 1000.0, "us": 0.001}


@dataclass(frozen=True)
class Slo:
    metric: str  # one of _SLO_METRICS
    limit_ms: float


def parse_slos(text: str) -> list[Slo]:
    """`ttft=500ms,tpot=50ms,e2el=2s` -> SLOs; a bare number means milliseconds."""
    slos = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        name = name.strip().lower()
        if not sep or name not in _SLO_METRICS:
            raise ValueError(f"bad SLO {item!r}: use NAME=VALUE with NAME one of {', '.join(_SLO_METRICS)}")
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(ms|s|us)?\s*", value)
        if not match:
            raise ValueError(f"bad SLO value {value!r}: use e.g. 500ms or 0.5s")
        slos.append(Slo(name, float(match.group(1)) * _UNIT_TO_MS[match.group(2) or "ms"]))
    return slos


def percentile_key(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def _latency_values_ms(results: list[RequestResult], metric: str) -> list[float]:
    if metric == "ttft":
        return [r.ttft_s * 1000 for r in results if r.completion_tokens > 0]
    if metric == "tpot":
        return [r.tpot_s * 1000 for r in results if r.completion_tokens > 1]
    if metric == "itl":
        return [itl * 1000 for r in results for itl in r.itl_s]
    return [r.e2el_s * 1000 for r in results]


def meets_slos(result: RequestResult, slos: list[Slo]) -> bool:
    values_ms = {"ttft": result.ttft_s * 1000, "tpot": result.tpot_s * 1000, "e2el": result.e2el_s * 1000}
    return result.success and all(values_ms[slo.metric] <= slo.limit_ms for slo in slos)


def _peak_output_tokens_per_s(results: list[RequestResult], run_start_s: float) -> float:
    # One streamed chunk counts as one token here: per-token server timestamps do not exist.
    seconds: Counter[int] = Counter()
    for r in results:
        t_s = r.start_s + r.ttft_s
        seconds[int(t_s - run_start_s)] += 1
        for itl_s in r.itl_s:
            t_s += itl_s
            seconds[int(t_s - run_start_s)] += 1
    return float(max(seconds.values())) if seconds else 0.0


def summarize(
    results: list[RequestResult],
    duration_s: float,
    *,
    slos: list[Slo] | None = None,
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES,
) -> dict[str, object]:
    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    duration_s = max(duration_s, 1e-9)
    total_input = sum(r.prompt_tokens for r in ok)
    total_output = sum(r.completion_tokens for r in ok)
    total_cached = sum(r.cached_tokens for r in ok)
    summary: dict[str, object] = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(failed),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "total_cached_tokens": total_cached,
        "cache_hit_ratio": total_cached / total_input if total_input else 0.0,
        "usage_reported_ratio": sum(r.usage_reported for r in ok) / len(ok) if ok else 0.0,
        "request_throughput": len(ok) / duration_s,
        "request_goodput": None,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "max_output_tokens_per_s": _peak_output_tokens_per_s(ok, min((r.start_s for r in ok), default=0)),
        "error_rate": len(failed) / len(results) if results else 0.0,
        "error_counts": dict(Counter(_error_kind(r.error) for r in failed).most_common()),
    }
    if slos:
        summary["slos_ms"] = {slo.metric: slo.limit_ms for slo in slos}
        summary["request_goodput"] = sum(meets_slos(r, slos) for r in ok) / duration_s
    for metric in LATENCY_METRICS:
        values = np.asarray(_latency_values_ms(ok, metric), dtype=float)
        has = values.size > 0
        summary[f"mean_{metric}_ms"] = float(values.mean()) if has else 0.0
        summary[f"median_{metric}_ms"] = float(np.median(values)) if has else 0.0
        summary[f"std_{metric}_ms"] = float(values.std()) if has else 0.0
        for p in percentiles:
            summary[f"p{percentile_key(p)}_{metric}_ms"] = float(np.percentile(values, p)) if has else 0.0
    summary.update(
        {
            "input_lens": [r.prompt_tokens for r in results],
            "output_lens": [r.completion_tokens for r in results],
            "cached_lens": [r.cached_tokens for r in results],
            "ttfts": [r.ttft_s for r in results],
            "itls": [r.itl_s for r in results],
            "e2els": [r.e2el_s for r in results],
            "session_ids": [r.session_id for r in results],
            "turns": [r.turn for r in results],
            "generated_texts": [r.generated_text for r in results],
            "errors": [r.error for r in results],
        }
    )
    return summary


def _error_kind(error: str) -> str:
    # Group "HTTP 500: boom 17" and "HTTP 500: boom 18" together without losing the status.
    head = error.split(":", 1)[0]
    return head if head.startswith("HTTP ") else error[:80]


def is_finite_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
