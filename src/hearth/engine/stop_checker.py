"""Stop strings over streamed text: find them across delta boundaries and never leak them.

The first stop string to *complete* wins (smallest end position; on a tie the longer one), so the
result does not depend on how the text was split into deltas.
"""

from __future__ import annotations


class StopStringMatcher:
    """Feed text deltas in order; get back what is safe to emit now and the stop string once matched.

    Without `include_stop_str_in_output`, any suffix that could still grow into a stop string is held
    back until it either completes one (and is dropped) or is ruled out (and is emitted). With it, text
    is emitted at once, since a stop string that completes later is part of the output anyway. After a
    match, nothing more is emitted.
    """

    def __init__(self, stop: list[str], include_stop_str_in_output: bool = False) -> None:
        self._stops = sorted({s for s in stop if s}, key=len, reverse=True)
        self._include = include_stop_str_in_output
        self._max_len = max((len(s) for s in self._stops), default=0)
        self._held = ""
        # Include mode only: the end of already-emitted text, where a stop string may have begun.
        self._tail = ""
        self._matched: str | None = None

    @property
    def matched(self) -> str | None:
        """The stop string that ended the text, or None while none has."""
        return self._matched

    @property
    def held_text(self) -> str:
        return self._held

    def feed(self, text_delta: str) -> tuple[str, str | None]:
        """Returns (text to emit now, the stop string if one completed in this delta)."""
        if self._matched is not None:
            return "", None
        if not self._stops:
            return text_delta, None
        buffer = self._held + text_delta
        window = self._tail + buffer
        match = self._first_completed(window)
        if match is not None:
            stop, start = match
            self._matched = stop
            self._held = ""
            emit_end = start + len(stop) if self._include else start
            return window[len(self._tail) : max(emit_end, len(self._tail))], stop
        if self._include:
            self._tail = window[-(self._max_len - 1) :] if self._max_len > 1 else ""
            return buffer, None
        keep = self._longest_partial_suffix(buffer)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep], None

    def flush(self) -> str:
        """The held-back text, for when the request ends for another reason (EOS, length)."""
        held, self._held = self._held, ""
        return held

    def _first_completed(self, text: str) -> tuple[str, int] | None:
        best: tuple[int, int, str] | None = None  # (end, -len, stop)
        for stop in self._stops:
            start = text.find(stop)
            if start < 0:
                continue
            key = (start + len(stop), -len(stop), stop)
            if best is None or key < best:
                best = key
        if best is None:
            return None
        end, neg_len, stop = best
        return stop, end + neg_len

    def _longest_partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stops:
            # Candidates start where the stop's first character occurs in the last len(stop)-1 chars;
            # str.find keeps the usual case (no such character) to one C-level scan.
            position = text.find(stop[0], max(0, len(text) - len(stop) + 1))
            while position >= 0 and len(text) - position > longest:
                if stop.startswith(text[position:]):
                    longest = len(text) - position
                    break
                position = text.find(stop[0], position + 1)
        return longest
