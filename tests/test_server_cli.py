"""`hearth serve`'s command line: vLLM's flags and recipes, `--config` files, models by Hub id, refusals."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from tiny_models import make_tiny_model

from hearth.server import cli as server_cli
from hearth.server.process import ServerProcess

COMMIT = "c" * 40

# A vLLM recipe's serve line, as published for Qwen3 (the words after `vllm serve`), unchanged.
VLLM_RECIPE = (
    "Qwen/Qwen3-0.6B --served-model-name qwen3 --max-model-len 32k --gpu-memory-utilization 0.9 "
    "--enable-prefix-caching --block-size 16 --max-num-seqs 8 --trust-remote-code --disable-log-requests "
    "--uvicorn-log-level warning --tensor-parallel-size 1 --enforce-eager --enable-auto-tool-choice "
    "--tool-call-parser hermes --reasoning-parser qwen3 "
    '--speculative-config \'{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}\''
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hearth serve")
    server_cli.add_arguments(parser)
    return parser


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An HF_HOME whose hub cache holds `Qwen/Qwen3-0.6B` (a tiny random Qwen3) at refs/main."""
    home = tmp_path_factory.mktemp("hf_home")
    repo = home / "hub" / "models--Qwen--Qwen3-0.6B"
    make_tiny_model(repo / "snapshots" / COMMIT, "qwen3", max_position_embeddings=40960)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return home


def _env(hf_home: Path) -> dict[str, str]:
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    env.pop("HUGGINGFACE_HUB_CACHE", None)
    return env


def test_a_vllm_recipe_serve_line_starts_and_answers(
    hf_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in _env(hf_home).items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    with ServerProcess(shlex.split(VLLM_RECIPE), tmp_path / "server.log") as server:
        models = httpx.get(server.url + "/v1/models").json()["data"]
        assert models[0]["id"] == "qwen3"
        assert models[0]["max_model_len"] == 32000
        for name in ("qwen3", "Qwen/Qwen3-0.6B"):
            answer = httpx.post(
                server.url + "/v1/chat/completions",
                json={"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
                timeout=60,
            )
            assert answer.status_code == 200, answer.text
            assert answer.json()["usage"]["completion_tokens"] >= 1
        assert "speculative decoding: ngram" in server.log()


def test_a_repo_id_not_in_the_cache_says_how_to_download_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = _parser().parse_args(["org/missing", "--revision", "v2", "--download-dir", str(tmp_path)])
    assert server_cli.run(args) == 2
    assert (
        f"huggingface-cli download org/missing --revision v2 --cache-dir {tmp_path}"
        in capsys.readouterr().err
    )


def test_a_path_that_does_not_exist_is_still_no_such_directory(capsys: pytest.CaptureFixture[str]) -> None:
    assert server_cli.run(_parser().parse_args(["--model", "/no/such/dir"])) == 2
    assert "no such directory" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("words", "message"),
    [
        (["--enable-lora", "--lora-modules", "a=/x"], "merge_and_unload"),
        (["--no-enable-chunked-prefill"], "--max-num-batched-tokens"),
        (["--data-parallel-size", "2"], "hearth route"),
        (["--kv-transfer-config", "{}"], "--role"),
        (["--load-format", "pt"], "safetensors"),
        (["m1", "--model", "m2"], "two models"),
    ],
)
def test_vllm_options_hearth_cannot_honour_are_refused_with_the_hearth_way(
    words: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert server_cli.run(_parser().parse_args(words)) == 2
    assert message in capsys.readouterr().err


def test_config_file_options_come_first_so_the_command_line_wins(tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text(
        "model: Qwen/Qwen3-0.6B\nport: 9001\nmax_model_len: 32k\nenable-prefix-caching: false\n"
        "served-model-name: [a, b]\nspeculative-config: {method: ngram, num_speculative_tokens: 2}\n"
        "trust-remote-code: true\nkv-integrity: off\n"
    )
    parser = _parser()
    args = parser.parse_args(
        server_cli.expand_config_file(parser, ["--config", str(config), "--port", "9002"])
    )
    assert (args.model, args.port, args.max_model_len) == ("Qwen/Qwen3-0.6B", 9002, 32000)
    assert (
        args.enable_prefix_caching is False and args.trust_remote_code is True and args.kv_integrity is False
    )
    assert args.served_model_name == ["a", "b"]
    assert args.speculative_config["num_speculative_tokens"] == 2


def test_config_file_with_an_unknown_option_is_a_usage_error(tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text("no-such-option: 1\n")
    with pytest.raises(SystemExit):
        server_cli.expand_config_file(_parser(), [f"--config={config}"])


def test_help_shows_defaults_and_version_prints() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    helped = subprocess.run(
        [sys.executable, "-m", "hearth.cli", "serve", "--help"], capture_output=True, text=True, env=env
    )
    assert re.search(r"--max-num-seqs.*\n?.*\(default: 256\)", helped.stdout), helped.stdout
    version = subprocess.run(
        [sys.executable, "-m", "hearth.cli", "--version"], capture_output=True, text=True
    )
    assert re.fullmatch(r"hearth \d+\.\d+\.\d+\n", version.stdout)


def test_port_0_logs_the_real_listening_address(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "tiny")
    log_path = tmp_path / "server.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "hearth.cli",
                "serve",
                str(model),
                "--port",
                "0",
                "--kv-cache-memory",
                "0.01",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 60
            match = None
            while match is None and time.monotonic() < deadline:
                match = re.search(r"listening on http://127\.0\.0\.1:(\d+)", log_path.read_text())
                time.sleep(0.1)
            assert match, log_path.read_text()
            port = int(match.group(1))
            assert port != 0
            ok = False
            while not ok and time.monotonic() < deadline:
                try:
                    ok = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
                except httpx.HTTPError:
                    time.sleep(0.2)
            assert ok
        finally:
            process.terminate()
            process.wait(30)


def test_a_tokenizer_that_does_not_exist_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = make_tiny_model(tmp_path / "tiny")
    args = _parser().parse_args([str(model), "--tokenizer", str(tmp_path / "nope")])
    assert server_cli.run(args) == 2
    assert "nope: no such directory" in capsys.readouterr().err
