"""`hearth bench serve` and `hearth bench compare` as real processes against a real fake server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

PYTHON = sys.executable


def _env() -> dict[str, str]:
    src = str(Path(__file__).resolve().parents[1] / "src")
    return {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}


@pytest.fixture
def fake_server_url():
    process = subprocess.Popen(
        [PYTHON, "-m", "hearth.bench.fake_server", "--port", "0", "--ttft-ms", "20", "--itl-ms", "5"],
        stdout=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    try:
        line = process.stdout.readline()
        assert "listening on" in line, line
        yield line.split()[-1]
    finally:
        process.terminate()
        process.wait(timeout=10)


def _hearth(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PYTHON, "-m", "hearth.cli", *args], capture_output=True, text=True, env=_env(), timeout=120, **kwargs
    )


def test_sweep_writes_json_markdown_plots_and_compares(fake_server_url, tmp_path):
    proc = _hearth(
        "bench", "serve", "--base-url", fake_server_url, "--model", "m", "--workload", "shared-prefix",
        "--num-prompts", "16", "--num-prefixes", "2", "--prefix-len", "64", "--suffix-len", "8",
        "--shared-output-len", "4", "--max-concurrency", "1,4", "--slo", "ttft=1s,tpot=1s",
        "--result-dir", str(tmp_path), "--label", "sp",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    for name in ("sp-c1.json", "sp-c4.json", "sp-sweep.json", "sp.md", "sp-cdf.png", "sp-sweep.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    run = json.loads((tmp_path / "sp-c4.json").read_text())
    assert run["completed"] == 16 and run["failed"] == 0 and run["max_concurrency"] == 4
    assert run["max_concurrent_requests"] == 4
    assert run["total_input_tokens"] == 16 * 72 and run["total_output_tokens"] == 16 * 4
    assert run["cache_hit_ratio"] == pytest.approx(14 * 64 / (16 * 72))  # 2 cold prefixes
    assert run["request_goodput"] == pytest.approx(run["request_throughput"])
    assert run["request_rate"] == "inf" and len(run["ttfts"]) == 16
    assert "| TTFT |" in proc.stdout and "max_concurrency" in proc.stdout

    compare = _hearth("bench", "compare", str(tmp_path / "sp-c1.json"), str(tmp_path / "sp-c4.json"))
    assert compare.returncode == 0, compare.stderr
    assert "| output_throughput |" in compare.stdout and "x" in compare.stdout
    sweep = _hearth("bench", "compare", str(tmp_path / "sp-sweep.json"), str(tmp_path / "sp-sweep.json"))
    assert "| 4 | output_throughput |" in sweep.stdout and "1.00x" in sweep.stdout


def test_failing_server_counts_errors_and_exits_cleanly(tmp_path):
    server = subprocess.Popen(
        [PYTHON, "-m", "hearth.bench.fake_server", "--port", "0", "--fail-every", "3", "--drop-every", "4"],
        stdout=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    try:
        url = server.stdout.readline().split()[-1]
        proc = _hearth(
            "bench", "serve", "--base-url", url, "--model", "m", "--num-prompts", "12", "--random-input-len",
            "8", "--random-output-len", "4", "--request-rate", "200", "--result-dir", str(tmp_path), "--no-plots",
        )  # fmt: skip
    finally:
        server.terminate()
        server.wait(timeout=10)
    assert proc.returncode == 0, proc.stderr
    run = json.loads((tmp_path / "random.json").read_text())
    # Requests 3, 6, 9, 12 fail with HTTP 500; 4 and 8 lose their stream.
    assert (run["completed"], run["failed"]) == (6, 6)
    assert run["error_counts"] == {"HTTP 500": 4, "stream ended before [DONE]": 2}
    assert "errors" in proc.stdout


def test_unreachable_server_and_bad_arguments_give_clear_errors(tmp_path):
    proc = _hearth(
        "bench", "serve", "--base-url", "http://127.0.0.1:19999", "--model", "m", "--num-prompts", "3",
        "--random-input-len", "4", "--random-output-len", "2", "--result-dir", str(tmp_path), "--no-plots",
    )  # fmt: skip
    assert proc.returncode == 0
    assert json.loads((tmp_path / "random.json").read_text())["failed"] == 3
    bad = _hearth("bench", "serve", "--base-url", "http://x", "--model", "m", "--max-concurrency", "1,2",
                  "--request-rate", "1,2")  # fmt: skip
    assert bad.returncode == 2 and "not both" in bad.stderr
    bad_slo = _hearth("bench", "serve", "--base-url", "http://x", "--model", "m", "--slo", "speed=1")
    assert bad_slo.returncode == 2 and "bad SLO" in bad_slo.stderr
    bad_compare = _hearth("bench", "compare", str(tmp_path / "random.md"), str(tmp_path / "random.json"))
    assert bad_compare.returncode == 2 and "cannot read" in bad_compare.stderr


def test_ctrl_c_still_prints_and_writes_the_summary(fake_server_url, tmp_path):
    process = subprocess.Popen(
        [PYTHON, "-m", "hearth.cli", "bench", "serve", "--base-url", fake_server_url, "--model", "m",
         "--num-prompts", "10000", "--random-input-len", "8", "--random-output-len", "50", "--request-rate", "20",
         "--result-dir", str(tmp_path), "--no-plots"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
    )  # fmt: skip
    deadline = time.monotonic() + 60  # startup is slow on a loaded machine: wait for real traffic
    while httpx.get(f"{fake_server_url}/v1/models").json()["num_requests"] < 5:
        assert time.monotonic() < deadline and process.poll() is None
        time.sleep(0.2)
    time.sleep(1.0)  # the first requests complete (each streams for ~0.3 s)
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=30)
    assert process.returncode == 130, stderr
    assert "Interrupted" in stdout and "| TTFT |" in stdout
    run = json.loads((tmp_path / "random.json").read_text())
    assert run["interrupted"] is True and 0 < run["completed"] < 10000 and run["failed"] == 0


def test_bench_serve_does_not_import_torch_or_matplotlib_up_front():
    code = (
        "import sys, hearth.bench.serve_cli, hearth.bench.compare; "
        "print(sorted(m for m in ('torch', 'transformers', 'matplotlib') if m in sys.modules))"
    )
    proc = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, env=_env(), timeout=60)
    assert proc.stdout.strip() == "[]", proc.stderr


def test_without_matplotlib_the_run_completes_without_plots_and_says_so_up_front(fake_server_url, tmp_path):
    # matplotlib blocked as if the [bench] extra were not installed.
    script = (
        "import sys; sys.modules['matplotlib'] = None; from hearth.cli import main; "
        f"sys.exit(main(['bench', 'serve', '--base-url', {fake_server_url!r}, '--model', 'm', "
        f"'--num-prompts', '4', '--result-dir', {str(tmp_path)!r}, '--label', 'np']))"
    )
    proc = subprocess.run([PYTHON, "-c", script], capture_output=True, text=True, env=_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "matplotlib is not installed" in proc.stderr and "Traceback" not in proc.stderr
    assert (tmp_path / "np.md").stat().st_size > 0 and not list(tmp_path.glob("*.png"))
