"""Stop strings in a token stream: cut at the first one, hold back what could begin one."""

from __future__ import annotations

from collections.abc import Sequence


def holdback_start(buf: str, patterns: Sequence[str]) -> int:
    """Index where the longest suffix of buf that begins some pattern starts (len(buf) if none)."""
    longest = max((len(p) for p in patterns), default=0)
    for start in range(max(0, len(buf) - longest + 1), len(buf)):
        tail = buf[start:]
        if any(p.startswith(tail) for p in patterns):
            return start
    return len(buf)


def earliest_match(buf: str, patterns: Sequence[str]) -> tuple[int, str] | None:
    """The pattern occurrence in buf that ends first (ties: starts first), or None."""
    best: tuple[int, int, str] | None = None
    for pattern in patterns:
        index = buf.find(pattern)
        if index >= 0:
            key = (index + len(pattern), index, pattern)
            if best is None or key < best:
                best = key
    return None if best is None else (best[1], best[2])


class StopMatcher:
    """Cuts a text stream at the first stop string, holding back possible partial matches.

    A stop made only of whitespace (the question frame's blank line) counts only once the answer
    has begun: leading whitespace is not an answer, and stopping there would leave none.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._buf = ""
        self._stopped = False
        self._begun = False  # non-whitespace text has been let through
        self.matched: str | None = None  # the stop string that ended the stream

    @property
    def stopped(self) -> bool:
        """Whether a stop string has been seen."""
        return self._stopped

    def feed(self, text: str) -> tuple[str, bool]:
        """Consume a streamed piece; return (text safe to emit, stopped)."""
        if self._stopped:
            return "", True
        if not self._stops:
            return text, False
        self._buf += text
        found = self._first_stop()
        if found is not None:
            out = self._buf[: found[0]]
            self._buf = ""
            self._stopped = True
            self.matched = found[1]
            return out, True
        start = holdback_start(self._buf, self._stops)
        out, self._buf = self._buf[:start], self._buf[start:]
        self._begun = self._begun or bool(out.strip())
        return out, False

    def flush(self) -> str:
        """Release held-back text at the end of the stream."""
        out, self._buf = self._buf, ""
        return "" if self._stopped else out

    def _first_stop(self) -> tuple[int, str] | None:
        """The stop that ends first in the buffer (ties: starts first), skipping whitespace stops
        that lie in the answer's leading whitespace."""
        best: tuple[int, int, str] | None = None
        for pattern in self._stops:
            at = self._buf.find(pattern)
            while at >= 0 and not pattern.strip() and not self._begun and not self._buf[:at].strip():
                at = self._buf.find(pattern, at + 1)
            if at >= 0:
                key = (at + len(pattern), at, pattern)
                if best is None or key < best:
                    best = key
        return None if best is None else (best[1], best[2])
