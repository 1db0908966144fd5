"""Hub repo ids found in a local Hugging Face cache (snapshots/refs layout), offline, at a revision."""

from __future__ import annotations

from pathlib import Path

import pytest

from hearth.model.hub_cache import ModelNotCachedError, looks_like_repo_id, resolve_cached_repo

MAIN = "a" * 40
OLD = "b" * 40


def fake_cache(root: Path) -> Path:
    """`models--org--tiny` with two snapshots: refs/main -> MAIN, refs/v1 (a tag) -> OLD."""
    repo = root / "models--org--tiny"
    for commit in (MAIN, OLD):
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True)
        (snapshot / "config.json").write_text(f'{{"commit": "{commit}"}}')
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN)
    (repo / "refs" / "v1").write_text(OLD)
    return root


def test_repo_id_resolves_to_the_main_snapshot(tmp_path: Path) -> None:
    cache = fake_cache(tmp_path)
    assert (
        resolve_cached_repo("org/tiny", cache_dir=str(cache)) == cache / "models--org--tiny/snapshots" / MAIN
    )


@pytest.mark.parametrize("revision", ["v1", OLD])
def test_revision_picks_a_tag_or_commit(tmp_path: Path, revision: str) -> None:
    cache = fake_cache(tmp_path)
    path = resolve_cached_repo("org/tiny", revision, str(cache))
    assert path.name == OLD


def test_a_repo_not_in_the_cache_says_how_to_download_it(tmp_path: Path) -> None:
    cache = fake_cache(tmp_path)
    with pytest.raises(ModelNotCachedError, match="huggingface-cli download org/other --revision dev"):
        resolve_cached_repo("org/other", "dev", str(cache))
    with pytest.raises(ModelNotCachedError, match="huggingface-cli download org/tiny --revision nope"):
        resolve_cached_repo("org/tiny", "nope", str(cache))


def test_hf_hub_cache_environment_is_read(tmp_path: Path) -> None:
    import subprocess
    import sys

    cache = fake_cache(tmp_path / "hub")
    code = "from hearth.model.hub_cache import resolve_cached_repo; print(resolve_cached_repo('org/tiny'))"
    import os

    env = {**os.environ, "HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    env.pop("HUGGINGFACE_HUB_CACHE", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(cache / "models--org--tiny/snapshots" / MAIN)


def test_what_looks_like_a_repo_id() -> None:
    assert looks_like_repo_id("Qwen/Qwen3-0.6B")
    assert looks_like_repo_id("gpt2")
    assert not looks_like_repo_id("../x/y")
    assert not looks_like_repo_id("/abs/path")
    assert not looks_like_repo_id("a/b/c")
