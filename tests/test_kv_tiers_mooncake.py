"""The Mooncake Store tier against a real master, inside a private network namespace.

Mooncake's master binds 0.0.0.0 and its transfer engine refuses loopback-only hosts, so the test runs
`unshare -rn` (an unprivileged user + network namespace: nothing is reachable from outside) with a veth
pair for a non-loopback address. Skipped where Mooncake is not installed or namespaces are not allowed.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent

SCRIPT = """
set -e
ip link set lo up
ip link add hv0 type veth peer name hv1
ip addr add 10.77.0.1/24 dev hv0
ip link set hv1 up
ip link set hv0 up
"$MASTER" --rpc_port 50051 --enable_http_metadata_server=true --http_metadata_server_host=127.0.0.1 \
    --http_metadata_server_port 8089 --metrics_port 9013 > "$WORK/master.log" 2>&1 &
MASTER_PID=$!
trap 'kill $MASTER_PID' EXIT
for i in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/50051) 2>/dev/null && break; sleep 0.1; done
URL="mooncake://127.0.0.1:50051?metadata=http://127.0.0.1:8089/metadata&local=10.77.0.1&segment_mb=32&buffer_mb=16"
"$PYTHON" "$CHECK" "$URL" "$URL"
"""


def _mooncake_master() -> str | None:
    found = shutil.which("mooncake_master") or str(Path(sys.executable).parent / "mooncake_master")
    return found if os.path.exists(found) else None


def test_two_servers_share_pages_through_mooncake_store(tmp_path: Path):
    if importlib.util.find_spec("mooncake") is None or _mooncake_master() is None:
        pytest.skip("mooncake-transfer-engine(-non-cuda) is not installed")
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"mooncake.store does not load here: {exc} (apt-get install libibverbs1)")
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rn", "true"]).returncode != 0:
        pytest.skip("unprivileged network namespaces (unshare -rn) are not allowed here")
    env = {
        **os.environ,
        "MASTER": _mooncake_master(),
        "PYTHON": sys.executable,
        "CHECK": str(HERE / "mooncake_tier_check.py"),
        "WORK": str(tmp_path),
        "PYTHONPATH": os.pathsep.join([str(HERE.parent / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(
        ["unshare", "-rn", "bash", "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), (
        result.stdout[-2000:] + result.stderr[-4000:]
    )
