"""Which checkpoint tensors are KV-cache scales: the loader skips them into the KV pool's scales."""

from __future__ import annotations

import re

_SCALE_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\..*?([kv])_scale$")


def kv_scale_target(name: str) -> tuple[int, str] | None:
    """(layer, "k" or "v") for a checkpoint KV-cache scale tensor's name, else None."""
    match = _SCALE_NAME.search(name)
    if match is None or ".weight_scale" in name or "input_scale" in name:
        return None
    return int(match.group(1)), match.group(2)
