"""Markdown summaries of bench runs (printed to the terminal and written next to the JSON)."""

from __future__ import annotations

from typing import Any

from hearth.bench.metrics import LATENCY_METRICS, percentile_key

_LATENCY_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2E latency"}


def _num(value: Any, digits: int = 2) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}"


def run_markdown(run: dict[str, Any], percentiles: tuple[float, ...]) -> str:
    lines = [f"### {run.get('label', 'run')} ({run.get('load', '')})", ""]
    if run.get("interrupted"):
        lines += ["**Interrupted (Ctrl-C): figures cover the requests that finished.**", ""]
    lines += [
        "| | |",
        "|---|---|",
        f"| requests completed / failed | {run['completed']} / {run['failed']} |",
        f"| duration (s) | {_num(run['duration'])} |",
        f"| requests/s | {_num(run['request_throughput'], 3)} |",
        f"| output tokens/s | {_num(run['output_throughput'], 1)} |",
        f"| total tokens/s | {_num(run['total_token_throughput'], 1)} |",
        f"| input / cached / output tokens | {run['total_input_tokens']:,} / "
        f"{run['total_cached_tokens']:,} / {run['total_output_tokens']:,} |",
        f"| cache-hit ratio | {run['cache_hit_ratio']:.1%} |",
        f"| max in-flight requests | {run.get('max_concurrent_requests', '–')} |",
        f"| client CPU (share of one core) | {run.get('client_cpu_util', 0.0):.0%} |",
    ]
    if run.get("request_goodput") is not None:
        slos = ", ".join(f"{k}≤{v:g}ms" for k, v in run.get("slos_ms", {}).items())
        lines.append(f"| goodput (req/s meeting {slos}) | {_num(run['request_goodput'], 3)} |")
    if run["failed"]:
        errors = "; ".join(f"{kind} ×{count}" for kind, count in run.get("error_counts", {}).items())
        lines.append(f"| errors | {errors} |")
    keys = [percentile_key(p) for p in percentiles]
    lines += [
        "",
        "| latency (ms) | mean | " + " | ".join(f"p{k}" for k in keys) + " |",
        "|---|---:|" + "---:|" * len(keys),
    ]
    for metric in LATENCY_METRICS:
        cells = [_num(run[f"mean_{metric}_ms"])] + [_num(run.get(f"p{k}_{metric}_ms")) for k in keys]
        lines.append(f"| {_LATENCY_NAMES[metric]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sweep_markdown(variable: str, runs: list[dict[str, Any]]) -> str:
    lines = [
        f"| {variable} | req/s | output tok/s | cache hit | TTFT p50 / p99 ms | TPOT p50 / p99 ms "
        "| ITL p50 / p99 ms | E2E p50 / p99 ms | goodput req/s | failed |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in runs:
        lat = [
            f"{run.get(f'median_{m}_ms', 0.0):,.1f} / {run.get(f'p99_{m}_ms', 0.0):,.1f}"
            for m in LATENCY_METRICS
        ]
        lines.append(
            f"| {run.get(variable, '–')} | {run['request_throughput']:.2f} | {run['output_throughput']:.1f} "
            f"| {run['cache_hit_ratio']:.1%} | " + " | ".join(lat) + f" | {_num(run.get('request_goodput'))} "
            f"| {run['failed']} |"
        )
    return "\n".join(lines)


def document_markdown(
    title: str,
    command: str,
    runs: list[dict[str, Any]],
    sweep_variable: str | None,
    percentiles: tuple[float, ...],
) -> str:
    parts = [f"# {title}", "", "```", command, "```", ""]
    if sweep_variable and len(runs) > 1:
        parts += [f"## Sweep over {sweep_variable}", "", sweep_markdown(sweep_variable, runs), ""]
    parts += ["## Runs", ""]
    for run in runs:
        parts += [run_markdown(run, percentiles), ""]
    return "\n".join(parts)
