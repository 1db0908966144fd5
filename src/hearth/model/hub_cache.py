"""`--model Qwen/Qwen3-0.6B`: a Hugging Face repo id, found in the local Hugging Face cache.

Offline only: the cache (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`, or
`--download-dir`) is read through `huggingface_hub` with `local_files_only`, at `--revision` (a branch, a
tag or a commit; default `main`). Nothing is downloaded: with no cached snapshot the error says how to
get one.
"""

from __future__ import annotations

import re
from pathlib import Path

# `org/name` (or a bare `name`): what the Hub accepts as a model repo id.
_REPO_ID = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9._-]{0,95}/)?[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")


class ModelNotCachedError(ValueError):
    pass


def looks_like_repo_id(name: str) -> bool:
    return bool(_REPO_ID.match(name)) and ".." not in name and not name.endswith((".gguf", ".json"))


def resolve_cached_repo(repo_id: str, revision: str | None = None, cache_dir: str | None = None) -> Path:
    """The snapshot directory of `repo_id` at `revision` in the local cache; ModelNotCachedError otherwise."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        snapshot = snapshot_download(
            repo_id, revision=revision, cache_dir=cache_dir, local_files_only=True, repo_type="model"
        )
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError) as exc:
        where = f" --cache-dir {cache_dir}" if cache_dir else ""
        at = f" --revision {revision}" if revision else ""
        raise ModelNotCachedError(
            f"{repo_id}{f' at revision {revision}' if revision else ''} is neither a directory nor in the "
            f"local Hugging Face cache ({cache_dir or _default_cache()}); download it first with "
            f"`huggingface-cli download {repo_id}{at}{where}` (or pass --model DIR)"
        ) from exc
    path = Path(snapshot)
    if not (path / "config.json").is_file():
        raise ModelNotCachedError(
            f"{repo_id}: the cached snapshot {path} has no config.json (an incomplete download?); "
            f"run `huggingface-cli download {repo_id}` again"
        )
    return path


def _default_cache() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)
