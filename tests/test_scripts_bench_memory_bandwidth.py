"""`scripts/bench_memory_bandwidth.py` on small arrays: every kernel reports a positive GB/s in its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_small_run_writes_positive_figures_for_every_kernel(tmp_path: Path) -> None:
    out = tmp_path / "bw.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "bench_memory_bandwidth.py"),
            "--size-mib", "2", "--repeats", "2", "--threads", "1", "--json", str(out),
        ],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    summary = json.loads(out.read_text())
    assert set(summary["gb_s"]) == {"copy", "scale", "add", "triad", "sum"}
    assert all(isinstance(v, float) and v > 0 for v in summary["gb_s"].values())
    assert summary["threads"] == 1 and summary["size_mib"] == 2
    assert summary["cpu"]["model_name"] in done.stdout
    assert "| triad |" in done.stdout


def test_bad_arguments_are_refused() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_memory_bandwidth.py"), "--threads", "0"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and "must be positive" in done.stderr
