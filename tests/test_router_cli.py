"""`hearth route` as a real process in front of fake worker processes."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).parent.parent
pytestmark = pytest.mark.timeout(90)


def free_ports(count: int) -> list[int]:
    """Ports in the router's test range (18300-18999) that can be bound right now."""
    ports: list[int] = []
    for port in range(18300, 19000):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == count:
            return ports
    raise RuntimeError("not enough free ports in 18300-18999")


def wait_ready(url: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1.0).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} not ready after {timeout_s} s")


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_route_command_serves_streams_and_json_through_real_processes(processes: list) -> None:
    *worker_ports, router_port = free_ports(3)
    fake_cmd = [sys.executable, str(ROOT / "scripts" / "router_fake_worker.py")]
    for port in worker_ports:
        fake_cmd += ["--port", str(port)]
    processes.append(subprocess.Popen(fake_cmd))
    for port in worker_ports:
        wait_ready(f"http://127.0.0.1:{port}/health")
    cmd = [sys.executable, "-m", "hearth.cli", "route", "--port", str(router_port), "--admin-key", "k"]
    for port in worker_ports:
        cmd += ["--worker", f"http://127.0.0.1:{port}"]
    processes.append(subprocess.Popen(cmd))
    base = f"http://127.0.0.1:{router_port}"
    wait_ready(base + "/health")

    names = set()
    for _ in range(4):
        resp = httpx.post(
            base + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
        )
        assert resp.status_code == 200
        names.add(resp.json()["worker"])
    assert names == {f"w{p}" for p in worker_ports}  # least-tokens ties rotate over both

    with httpx.stream("POST", base + "/v1/completions", json={"prompt": "hi", "stream": True}) as resp:
        events = [line for line in resp.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and len(events) == 4
    workers = httpx.get(base + "/admin/workers", headers={"authorization": "Bearer k"}).json()["workers"]
    assert all(w["healthy"] and w["in_flight_requests"] == 0 for w in workers)
    assert "hearth_router_requests_total" in httpx.get(base + "/metrics").text


def test_router_modules_do_not_import_torch_or_transformers() -> None:
    code = (
        "import sys, hearth.router.cli, hearth.router.app; "
        "print(json.dumps(sorted(m for m in ('torch', 'transformers') if m in sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", "import json; " + code], capture_output=True, text=True, check=True, timeout=60
    )
    assert json.loads(out.stdout) == []


def test_bad_command_lines_exit_with_a_clear_message() -> None:
    cmd = [sys.executable, "-m", "hearth.cli", "route", "--prefill", "http://127.0.0.1:18990"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "needs both --prefill and --decode" in out.stdout
    out = subprocess.run(cmd[:4] + ["--worker", "localhost:1"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "must start with http://" in out.stdout
    sglang = cmd + ["--decode", "http://127.0.0.1:18991", "--pd-protocol", "sglang"]
    out = subprocess.run(sglang, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--prefill URL BOOTSTRAP_PORT" in out.stdout


def test_worker_urls_takes_several_servers_beside_worker() -> None:
    import argparse

    from hearth.router.cli import add_arguments, pool_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--worker", "http://a:1", "--worker-urls", "http://b:2", "http://c:3", "--worker-urls", "http://d:4"]
    )
    pool = pool_from_args(args)
    assert sorted(pool.workers) == ["http://a:1", "http://b:2", "http://c:3", "http://d:4"]
    assert {worker.role for worker in pool.workers.values()} == {"mixed"}
