"""`hearth bench compare A.json B.json`: side-by-side figures and B/A ratios of two bench results.

Accepts single-run files and sweep files (`<label>-sweep.json`); sweeps are matched point by
point on the swept value. Works on vLLM `bench serve` result files too, for the shared fields.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from hearth.bench.metrics import is_finite_number

# (field, higher is better)
COMPARED_FIELDS: tuple[tuple[str, bool], ...] = (
    ("request_throughput", True),
    ("request_goodput", True),
    ("output_throughput", True),
    ("total_token_throughput", True),
    ("cache_hit_ratio", True),
    ("mean_ttft_ms", False),
    ("median_ttft_ms", False),
    ("p99_ttft_ms", False),
    ("mean_tpot_ms", False),
    ("median_tpot_ms", False),
    ("p99_tpot_ms", False),
    ("median_itl_ms", False),
    ("p99_itl_ms", False),
    ("median_e2el_ms", False),
    ("p99_e2el_ms", False),
    ("failed", False),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("baseline", help="result JSON A (the ratio's denominator)")
    parser.add_argument("candidate", help="result JSON B")
    parser.add_argument("--fields", default=None, help="comma list of fields (default: a standard set)")


def load_runs(path: Path) -> tuple[str | None, list[dict[str, Any]]]:
    """(swept variable or None, runs) from a single-run or sweep result file."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a bench result (expected a JSON object)")
    if "runs" in data:
        return data.get("sweep_variable"), list(data["runs"])
    if "completed" not in data:
        raise ValueError(f"{path} is not a bench result (no 'completed' field)")
    return None, [data]


def _format(value: Any) -> str:
    if not is_finite_number(value):
        return "–"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:,.3f}" if abs(value) < 10 else f"{value:,.1f}"


def ratio_cell(a: Any, b: Any, higher_is_better: bool) -> str:
    if not (is_finite_number(a) and is_finite_number(b)) or a == 0:
        return "–"
    ratio = b / a
    better = ratio > 1 if higher_is_better else ratio < 1
    return f"{ratio:.2f}x" + (" (better)" if better and ratio != 1 else "")


def compare_table(
    runs_a: list[dict[str, Any]],
    runs_b: list[dict[str, Any]],
    variable: str | None,
    fields: tuple[tuple[str, bool], ...],
    names: tuple[str, str],
) -> str:
    if variable:
        by_value_b = {run.get(variable): run for run in runs_b}
        pairs = [(run, by_value_b[run.get(variable)]) for run in runs_a if run.get(variable) in by_value_b]
        if not pairs:
            raise ValueError(f"the two sweeps share no {variable} value")
    else:
        pairs = list(zip(runs_a, runs_b, strict=False))
    header = ([variable] if variable else []) + ["metric", names[0], names[1], "B/A"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for run_a, run_b in pairs:
        for field, higher_is_better in fields:
            if field not in run_a and field not in run_b:
                continue
            a, b = run_a.get(field), run_b.get(field)
            cells = [str(run_a.get(variable))] if variable else []
            cells += [field, _format(a), _format(b), ratio_cell(a, b, higher_is_better)]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        variable_a, runs_a = load_runs(Path(args.baseline))
        variable_b, runs_b = load_runs(Path(args.candidate))
        if (variable_a is None) != (variable_b is None) or (variable_a and variable_a != variable_b):
            raise ValueError(f"cannot compare a sweep over {variable_a} with one over {variable_b}")
        fields = COMPARED_FIELDS
        if args.fields:
            wanted = [f.strip() for f in args.fields.split(",") if f.strip()]
            known = dict(COMPARED_FIELDS)
            fields = tuple((f, known.get(f, not f.endswith("_ms"))) for f in wanted)
        names = (f"A: {Path(args.baseline).name}", f"B: {Path(args.candidate).name}")
        print(compare_table(runs_a, runs_b, variable_a, fields, names))
    except ValueError as exc:
        print(f"hearth bench compare: error: {exc}", file=sys.stderr)
        return 2
    return 0
