"""PNG plots of bench runs. matplotlib is imported here only, and only when plots are written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from hearth.bench.metrics import LATENCY_METRICS

_TITLES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "inter-token latency", "e2el": "end-to-end latency"}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    return plt


def _values_ms(run: dict[str, Any], metric: str) -> np.ndarray:
    ok = [not e for e in run["errors"]]
    if metric == "ttft":
        values = [
            t for t, good, n in zip(run["ttfts"], ok, run["output_lens"], strict=True) if good and n > 0
        ]
    elif metric == "itl":
        values = [x for itls, good in zip(run["itls"], ok, strict=True) if good for x in itls]
    elif metric == "e2el":
        values = [t for t, good in zip(run["e2els"], ok, strict=True) if good]
    else:
        values = [
            (e2e - ttft) / (n - 1)
            for e2e, ttft, n, good in zip(run["e2els"], run["ttfts"], run["output_lens"], ok, strict=True)
            if good and n > 1
        ]
    return np.sort(np.asarray(values, dtype=float) * 1000)


def plot_latency_cdfs(runs: list[dict[str, Any]], path: Path) -> Path:
    """One panel per latency metric, one CDF line per run."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, metric in zip(axes.flat, LATENCY_METRICS, strict=True):
        spans = []
        for run in runs:
            values = _values_ms(run, metric)
            if values.size:
                fractions = np.arange(1, values.size + 1) / values.size
                ax.step(values, fractions, where="post", label=run.get("load", ""))
                spans.append((values[0], values[-1]))
        # Latency tails span orders of magnitude; a log axis keeps the body of the curve readable.
        if (
            spans
            and min(lo for lo, _ in spans) > 0
            and max(hi for _, hi in spans) / min(lo for lo, _ in spans) > 50
        ):
            ax.set_xscale("log")
        ax.set_title(f"{_TITLES[metric]} CDF")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests" if metric != "itl" else "fraction of tokens")
        ax.grid(alpha=0.3)
        if len(runs) > 1:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_sweep(variable: str, runs: list[dict[str, Any]], path: Path) -> Path:
    """Throughput and p50/p99 latencies against the swept concurrency or request rate."""
    plt = _pyplot()
    xs = [run[variable] for run in runs]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    axes[0].plot(xs, [r["output_throughput"] for r in runs], marker="o", label="output tok/s")
    axes[0].plot(xs, [r["total_token_throughput"] for r in runs], marker="o", label="total tok/s")
    axes[0].set_title("throughput")
    axes[0].set_ylabel("tokens/s")
    for ax, metrics, title in (
        (axes[1], ("ttft", "e2el"), "TTFT, E2E"),
        (axes[2], ("tpot", "itl"), "TPOT, ITL"),
    ):
        for metric in metrics:
            ax.plot(xs, [r[f"median_{metric}_ms"] for r in runs], marker="o", label=f"{metric} p50")
            ax.plot(
                xs, [r.get(f"p99_{metric}_ms", 0.0) for r in runs], marker="x", ls="--", label=f"{metric} p99"
            )
        ax.set_title(f"{title} latency")
        ax.set_ylabel("ms")
    for ax in axes:
        ax.set_xlabel(variable)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
