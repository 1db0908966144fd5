"""`hearth launch`: a real router + prefill + decode deployment, answered through, stopped with no orphans."""

from __future__ import annotations

import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
from tiny_models import make_tiny_model

from hearth.server.process import free_port


def test_secret_options_leave_the_command_line_for_the_environment() -> None:
    from hearth.launch import secrets_to_env

    kept, env = secrets_to_env(
        ["--admin-key", "a1", "--policy", "x", "--api-key=k2", "--kv-transfer-secret", "s3"]
    )
    assert kept == ["--policy", "x"]
    assert env == {"HEARTH_ROUTER_ADMIN_KEY": "a1", "HEARTH_API_KEY": "k2", "HEARTH_KV_TRANSFER_SECRET": "s3"}
    with pytest.raises(ValueError, match="needs a value"):
        secrets_to_env(["--admin-key"])


def test_bad_counts_exit_with_a_message() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "hearth.cli", "launch", "--prefill", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "--decode" in result.stderr


@pytest.mark.timeout(1200)
def test_launch_starts_answers_and_stops_every_child(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "tiny")
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "hearth.cli",
        "launch",
        "--model",
        str(model),
        "--prefill",
        "1",
        "--decode",
        "1",
    ]
    command += [
        "--port",
        str(port),
        "--server-args",
        "--max-model-len 512 --kv-cache-memory 0.02 --page-size 8",
    ]
    command += ["--decode-args", "--kv-transfer-timeout 10", "--ready-timeout", "900"]
    command += ["--router-args=--admin-key admin-topsecret"]  # moved into the router's environment
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue[str] = queue.Queue()
    seen: list[str] = []
    threading.Thread(target=lambda: [lines.put(line) for line in launcher.stdout], daemon=True).start()  # type: ignore[union-attr]
    try:
        deadline = time.monotonic() + 900
        while not any("hearth launch: ready at" in line for line in seen):
            assert launcher.poll() is None and time.monotonic() < deadline, "".join(seen[-50:])
            try:
                seen.append(lines.get(timeout=1))
            except queue.Empty:
                pass
        children = psutil.Process(launcher.pid).children(recursive=True)
        assert len(children) >= 5  # prefill and decode (each with its engine core) and the router
        for child in children:  # what `ps` shows of every child: no secret
            argv = " ".join(child.cmdline())
            assert "topsecret" not in argv and "secret" not in argv.replace("secret-file", ""), argv
        admin = httpx.get(
            f"http://127.0.0.1:{port}/admin/workers", headers={"authorization": "Bearer admin-topsecret"}
        )
        assert admin.status_code == 200 and len(admin.json()["workers"]) == 2
        answer = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"prompt": "launched " * 20, "max_tokens": 5, "temperature": 0},
            timeout=120,
        )
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 5
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(120) == 0
        gone, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, alive
        while True:
            try:
                seen.append(lines.get(timeout=1))
            except queue.Empty:
                break
        text = "".join(seen)
        assert "[prefill-0] " in text and "[decode-0] " in text and "[router] " in text
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
