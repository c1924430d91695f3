"""Stop strings over a text stream: emit what is safe, hold back what could still become a stop string.

Contract: no character of a stop string is ever emitted (unless include_stop_str_in_output), however the
text was split into deltas, because a suffix of the text that is a prefix of some stop string is held back
until it either completes a stop string or can no longer become one.

Which stop string wins: the one that completes first in the text (earliest end); when several end at the
same character, the longest (the one that starts earliest). This is the only rule whose result does not
depend on how the text was split into deltas: with stops "b" and "abc", streaming "a", "b", "c" must stop
at "b" since "c" may never come, so "abc" delivered at once stops at "b" too. The output is cut where the
winning stop string starts (or ends, with include_stop_str_in_output).
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Feeds text deltas of one choice; reports the first stop string. Empty stop strings are ignored."""

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        self._stops = tuple(dict.fromkeys(s for s in stop if s))  # deduplicated, order kept
        self._include = include_stop_str_in_output
        self._first_chars = frozenset(s[0] for s in self._stops)
        self._max_held = max((len(s) for s in self._stops), default=1) - 1
        self._held = ""
        self._matched: str | None = None

    @property
    def matched(self) -> str | None:
        """The stop string that ended the stream, if one did."""
        return self._matched

    def feed(self, text_delta: str) -> tuple[str, str | None]:
        """Returns (text safe to emit now, the stop string if this delta completed one).

        After a match every later call returns ("", None).
        """
        if self._matched is not None:
            return "", None
        if not self._stops:
            return text_delta, None
        text = self._held + text_delta
        # The held text is a proper prefix of a stop string, so any occurrence found ends in the delta.
        match = self._first_match(text)
        if match is not None:
            start, stop = match
            self._held = ""
            self._matched = stop
            return text[: start + len(stop)] if self._include else text[:start], stop
        keep = self._partial_suffix_len(text)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep], None

    def flush(self) -> str:
        """Releases the held-back text (the stream ended for another reason); "" after a match."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None  # (end, -length, stop)
        for stop in self._stops:
            start = text.find(stop)
            if start >= 0:
                key = (start + len(stop), -len(stop), stop)
                if best is None or key < best:
                    best = key
        if best is None:
            return None
        end, _, stop = best
        return end - len(stop), stop

    def _partial_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        # A full stop string cannot be a suffix here (it would have matched), so proper prefixes suffice.
        for i in range(max(0, len(text) - self._max_held), len(text)):
            if text[i] in self._first_chars:
                tail = text[i:]
                if any(s.startswith(tail) for s in self._stops):
                    return len(text) - i
        return 0
