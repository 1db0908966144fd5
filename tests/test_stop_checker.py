"""StopStringMatcher: stop strings split across deltas are caught, never leaked, and nothing follows them."""

from __future__ import annotations

import random

import pytest

from hearth.engine.stop_checker import StopStringMatcher


def _run(stops: list[str], deltas: list[str], include: bool = False) -> tuple[list[str], str | None, str]:
    matcher = StopStringMatcher(stops, include_stop_str_in_output=include)
    emitted: list[str] = []
    matched = None
    for delta in deltas:
        text, stop = matcher.feed(delta)
        emitted.append(text)
        if stop is not None:
            assert matched is None, "a second match after the first"
            matched = stop
    return emitted, matched, matcher.flush()


def _reference(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """The first stop string to complete (smallest end, then longest) cuts the text."""
    best = None
    for stop in stops:
        start = text.find(stop)
        if start >= 0 and (
            best is None or (start + len(stop), -len(stop)) < (best[0] + len(best[1]), -len(best[1]))
        ):
            best = (start, stop)
    if best is None:
        return text, None
    start, stop = best
    return text[: start + len(stop)] if include else text[:start], stop


def test_no_stops_passes_text_through() -> None:
    emitted, matched, rest = _run([], ["ab", "cd"])
    assert emitted == ["ab", "cd"] and matched is None and rest == ""


def test_stop_inside_one_delta_cuts_it_and_drops_the_rest() -> None:
    emitted, matched, rest = _run(["STOP"], ["hello STOP world", "more"])
    assert emitted == ["hello ", ""] and matched == "STOP" and rest == ""


def test_stop_split_across_single_char_deltas_is_never_leaked() -> None:
    matcher = StopStringMatcher(["</answer>"])
    out = []
    for ch in "42</answer> trailing":
        text, stop = matcher.feed(ch)
        out.append(text)
        assert "<" not in "".join(out)
        if stop:
            break
    assert "".join(out) == "42" and matcher.matched == "</answer>"


def test_false_start_is_released_when_ruled_out() -> None:
    matcher = StopStringMatcher(["abc"])
    assert matcher.feed("xa") == ("x", None)
    assert matcher.feed("b") == ("", None)
    assert matcher.held_text == "ab"
    assert matcher.feed("d") == ("abd", None)
    assert matcher.flush() == ""


def test_flush_returns_held_text_when_request_ends_otherwise() -> None:
    matcher = StopStringMatcher(["###"])
    assert matcher.feed("done ##") == ("done ", None)
    assert matcher.flush() == "##"
    assert matcher.flush() == ""


def test_stop_at_start() -> None:
    assert _run(["<|end|>"], ["<|end|>", "x"]) == (["", ""], "<|end|>", "")
    assert _run(["<|end|>"], ["<|en", "d|>x"]) == (["", ""], "<|end|>", "")


def test_include_stop_str_in_output_emits_the_stop_and_nothing_after() -> None:
    emitted, matched, _ = _run(["STOP"], ["hello ST", "OP and more"], include=True)
    assert "".join(emitted) == "hello STOP" and matched == "STOP"
    # Include mode does not hold text back: a partial stop is emitted at once.
    assert emitted[0] == "hello ST"


def test_first_completed_stop_wins_among_several() -> None:
    # "bc" completes before "abcd", whichever order the stops are given in.
    for stops in (["abcd", "bc"], ["bc", "abcd"]):
        assert _run(stops, ["abcd"]) == (["a"], "bc", "")
        assert _run(stops, list("abcd")) == (["", "", "a", ""], "bc", "")


def test_overlapping_stops_tie_goes_to_the_longer() -> None:
    # "ab" and "b" complete at the same character: the longer one cuts more.
    assert _run(["b", "ab"], ["xab"]) == (["x"], "ab", "")


def test_self_overlapping_stop() -> None:
    # "aab" inside "aaab": the held suffix must restart correctly after "aaa".
    emitted, matched, _ = _run(["aab"], list("xaaab"))
    assert "".join(emitted) == "xa" and matched == "aab"


def test_empty_stop_strings_are_ignored() -> None:
    assert _run(["", "Z"], ["abc"]) == (["abc"], None, "")


def test_after_a_match_nothing_more_is_emitted() -> None:
    matcher = StopStringMatcher(["x"])
    assert matcher.feed("ax") == ("a", "x")
    assert matcher.feed("more") == ("", None)
    assert matcher.flush() == ""


@pytest.mark.parametrize("include", [False, True])
def test_random_splits_equal_the_whole_text_reference(include: bool) -> None:
    rng = random.Random(1234)
    alphabet = "ab<>/ "
    for _ in range(600):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stops = [
            "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))
        ]
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 8))))
        deltas = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        expected, expected_stop = _reference(text, stops, include)

        matcher = StopStringMatcher(stops, include_stop_str_in_output=include)
        emitted = ""
        matched = None
        for delta in deltas:
            piece, stop = matcher.feed(delta)
            emitted += piece
            # Never leak: what is out is always a prefix of the final answer.
            assert expected.startswith(emitted), (text, stops, deltas, emitted)
            matched = matched or stop
        if matched is None:
            emitted += matcher.flush()
        assert (emitted, matched) == (expected, expected_stop), (text, stops, deltas)
