"""Streaming text helpers shared by the tool-call and reasoning parsers: holding back half-written markers."""

from __future__ import annotations


def partial_suffix_len(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers` (to hold back)."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:size]):
                longest = size
                break
    return longest


def hold_back(text: str, markers: tuple[str, ...]) -> str:
    """`text` without a trailing half-written marker."""
    return text[: len(text) - partial_suffix_len(text, markers)]
