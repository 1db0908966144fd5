"""`scripts/chaos.py --short`: fuzzed requests, disconnects, a burst, a big request, a short soak, a worker
SIGKILLed behind `hearth route`, a PD + tiers deployment under attack (issue 30) and SIGTERM under load, against a real server. Any 5xx, crash, hang, leaked
page or lost request fails it (the stall and RSS goals are enforced in the full mode only)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hearth.server.cli import DEFAULT_MODEL_DIR

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not (DEFAULT_MODEL_DIR / "config.json").is_file(), reason="no demo model")
def test_chaos_short_mode_passes() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "chaos.py"), "--short", "--kv-cache-memory", "0.05"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    table = result.stdout[result.stdout.index("| phase") :]
    for phase in (
        "fuzz",
        "disconnect",
        "burst",
        "big-request",
        "soak",
        "router-kill",
        "pd-hostile",
        "sigterm",
    ):
        assert f"| {phase}" in table
