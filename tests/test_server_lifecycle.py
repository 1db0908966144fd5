"""`hearth serve` as a process: loading, admission control under load, failures at start, SIGTERM."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from fastapi.testclient import TestClient
from tiny_models import make_tiny_model

from hearth.engine.messages import EngineStats
from hearth.model.tokenizer import Tokenizer
from hearth.server import cli as server_cli
from hearth.server.app import build_app
from hearth.server.process import ServerProcess, free_port
from hearth.server.state import ServerConfig


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("lifecycle") / "tiny")


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    # Room for 2 running + 1 waiting sequence: the 4th concurrent request is refused.
    args = [
        "--model",
        str(model_dir),
        "--max-num-seqs",
        "2",
        "--max-queued-requests",
        "1",
        "--kv-cache-memory",
        "0.02",
        "--max-model-len",
        "2048",
        "--shutdown-timeout",
        "20",
    ]
    process = ServerProcess(args, tmp_path_factory.mktemp("logs") / "server.log").start()
    try:
        yield process
    finally:
        process.stop()


def test_health_says_loading_until_the_model_is_ready(server: ServerProcess) -> None:
    first = None
    deadline = time.monotonic() + 120
    while first is None:
        assert time.monotonic() < deadline, server.log()
        try:
            first = httpx.get(server.url + "/health", timeout=2)
        except httpx.TransportError:
            time.sleep(0.05)
    assert first.status_code == 503 and first.json() == {"status": "loading"}
    early = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert early.status_code in (200, 503)  # 503 (with an OpenAI error) while loading
    if early.status_code == 503:
        assert early.json()["error"]["code"] == "model_loading"
    server.wait_ready()
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def _hold_stream(url: str, started: threading.Event, release: threading.Event, statuses: list[int]) -> None:
    body = {"prompt": "keep going", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
        statuses.append(response.status_code)
        started.set()
        release.wait(60)


def test_requests_beyond_the_queue_get_429_with_retry_after(server: ServerProcess) -> None:
    server.wait_ready()
    release = threading.Event()
    statuses: list[int] = []
    threads = []
    for _ in range(3):
        started = threading.Event()
        thread = threading.Thread(target=_hold_stream, args=(server.url, started, release, statuses))
        thread.start()
        assert started.wait(30)
        threads.append(thread)
    try:
        assert statuses == [200, 200, 200]
        refused = httpx.post(server.url + "/v1/completions", json={"prompt": "one more", "max_tokens": 2})
        assert refused.status_code == 429
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["code"] == "queue_full"
        refused_n = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "n": 2})
        assert refused_n.status_code == 429
        metrics = httpx.get(server.url + "/metrics").text
        rejected = [
            line for line in metrics.splitlines() if line.startswith("hearth_requests_rejected_total")
        ]
        assert rejected and float(rejected[0].split()[-1]) == 2
    finally:
        release.set()
        for thread in threads:
            thread.join(30)
    deadline = time.monotonic() + 20
    while httpx.get(server.url + "/load").json()["running_requests"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    accepted = httpx.post(
        server.url + "/v1/completions", json={"prompt": "again", "max_tokens": 2}, timeout=30
    )
    assert accepted.status_code == 200


def test_sigterm_finishes_the_in_flight_stream_then_exits_0(server: ServerProcess) -> None:
    server.wait_ready()
    assert server.process is not None
    body = {
        "prompt": "finish me",
        "max_tokens": 40,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = []
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        lines = (line for line in response.iter_lines() if line)
        events.append(next(lines))
        server.process.terminate()  # SIGTERM mid-stream
        events.extend(lines)
    assert events[-1] == "data: [DONE]"
    usage = json.loads(events[-2][len("data: ") :])["usage"]
    assert usage["completion_tokens"] == 40
    assert server.process.wait(30) == 0
    with pytest.raises(httpx.TransportError):
        httpx.get(server.url + "/health", timeout=2)


def test_a_model_that_fails_to_load_exits_1_with_the_reason(tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    process = ServerProcess(["--model", str(broken)], tmp_path / "log.txt", port=free_port()).start()
    assert process.process is not None
    assert process.process.wait(120) == 1
    assert "could not load" in process.log()


def test_no_model_and_no_demo_model_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(server_cli, "DEFAULT_MODEL_DIR", tmp_path / "models" / "demo")
    parser = argparse.ArgumentParser()
    server_cli.add_arguments(parser)
    assert server_cli.run(parser.parse_args([])) == 2
    message = capsys.readouterr().err
    assert "no default model exists" in message and "--model" in message


def _core_pid(server: ServerProcess) -> int:
    match = re.search(r"engine core process started \(pid (\d+)", server.log())
    assert match, server.log()
    return int(match.group(1))


def test_when_the_engine_core_dies_in_flight_requests_get_503_and_the_server_exits_1(
    model_dir: Path, tmp_path: Path
) -> None:
    args = ["--model", str(model_dir), "--kv-cache-memory", "0.02", "--max-model-len", "2048"]
    server = ServerProcess(args, tmp_path / "server.log").start()
    try:
        server.wait_ready()
        assert server.process is not None
        core_pid = _core_pid(server)
        answers: list[httpx.Response] = []
        body = {"prompt": "keep going", "max_tokens": 2000, "ignore_eos": True}
        waiting = threading.Thread(
            target=lambda: answers.append(httpx.post(server.url + "/v1/completions", json=body, timeout=60))
        )
        waiting.start()
        with httpx.stream(
            "POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60
        ) as response:
            lines = (line for line in response.iter_lines() if line)
            next(lines)
            deadline = time.monotonic() + 30
            while httpx.get(server.url + "/load").json()["running_requests"] < 2:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            os.kill(core_pid, signal.SIGKILL)
            rest = list(lines)
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][len("data: ") :])["error"]
        assert "engine core process was killed by SIGKILL" in error["message"]
        waiting.join(30)
        assert answers and answers[0].status_code == 503
        assert "engine core process was killed" in answers[0].json()["error"]["message"]
        assert server.process.wait(30) == 1
        assert "engine core process was killed by SIGKILL" in server.log()
    finally:
        server.stop()


def test_the_engine_core_exits_when_the_server_is_killed(model_dir: Path, tmp_path: Path) -> None:
    server = ServerProcess(["--model", str(model_dir), "--kv-cache-memory", "0.02"], tmp_path / "log").start()
    try:
        server.wait_ready()
        assert server.process is not None
        core = psutil.Process(_core_pid(server))
        server.process.kill()
        server.process.wait(10)
        deadline = time.monotonic() + 10
        while _alive(core):
            assert time.monotonic() < deadline, "the engine core outlived the server"
            time.sleep(0.05)
    finally:
        server.stop()


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class _FakeEngine:
    """Just enough of `AsyncEngine` for the app: ready at once, dead when the test says so."""

    def __init__(self, model_dir: Path) -> None:
        self.tokenizer = Tokenizer.from_dir(model_dir)
        self.max_model_len = 64
        self.num_kv_tokens = 64
        self.model_name = "tiny"
        self.dead: str | None = None

    def stats(self) -> EngineStats:
        return EngineStats(0, 0, 0, 4, 0, 0, 0, 0, 0, 0)

    def shutdown(self) -> None:
        pass


def test_a_dead_engine_fails_health_and_new_requests_get_503(model_dir: Path) -> None:
    engine = _FakeEngine(model_dir)
    app = build_app(ServerConfig(model_name="tiny"), lambda: engine, str(model_dir), 4)  # type: ignore[arg-type,return-value]
    with TestClient(app) as client:
        deadline = time.monotonic() + 10
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        engine.dead = "the engine core process was killed by SIGKILL"
        health = client.get("/health")
        assert health.status_code == 503
        assert health.json() == {"status": "failed", "error": engine.dead}
        refused = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert refused.status_code == 503
        error = refused.json()["error"]
        assert error["code"] == "engine_dead" and engine.dead in error["message"]
