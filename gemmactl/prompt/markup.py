"""Thinking markup in a token stream: split answer from thinking, remove the markers."""

from __future__ import annotations

from gemmactl.prompt.stops import earliest_match, holdback_start

ANSWER = "answer"
THINKING = "thinking"

# Gemma 4 writes "<|channel>thought\n...<channel|>"; other models write "<think>...</think>".
GEMMA_OPEN = "<|channel>thought"
OPEN_MARKERS = (GEMMA_OPEN, "<think>")
CLOSE_MARKERS = ("<channel|>", "</think>")
ALL_MARKERS = OPEN_MARKERS + CLOSE_MARKERS


class MarkupCleaner:
    """Splits streamed model output into answer and thinking, removing the markers."""

    def __init__(self) -> None:
        self._buf = ""
        self._in_thought = False
        self._strip_header_newline = False
        self._strip_answer_space = False
        self._out: list[tuple[str, str]] = []

    @property
    def in_thought(self) -> bool:
        """Whether the stream is currently inside a thought block."""
        return self._in_thought

    def feed(self, text: str) -> list[tuple[str, str]]:
        """Consume a streamed piece; return the (channel, text) pieces now safe to emit."""
        self._buf += text
        while self._buf:
            if self._strip_header_newline:
                # Only the first character after the marker can be the header's newline.
                self._strip_header_newline = False
                if self._buf.startswith("\n"):
                    self._buf = self._buf[1:]
                    continue
            found = earliest_match(self._buf, ALL_MARKERS)
            if found is None:
                break
            index, marker = found
            self._emit(self._buf[:index])
            self._buf = self._buf[index + len(marker) :]
            self._on_marker(marker)
        # A marker may still be arriving: keep back only the part that could begin one.
        start = holdback_start(self._buf, ALL_MARKERS)
        self._emit(self._buf[:start])
        self._buf = self._buf[start:]
        return self._take()

    def flush(self) -> list[tuple[str, str]]:
        """Release whatever was held back at the end of the stream."""
        self._emit(self._buf)
        self._buf = ""
        return self._take()

    def _on_marker(self, marker: str) -> None:
        """Update state for a marker just removed from the stream."""
        if marker in OPEN_MARKERS:
            self._in_thought = True
            self._strip_header_newline = marker == GEMMA_OPEN
        elif self._in_thought:
            self._in_thought = False
            self._strip_answer_space = True
        # A stray closing marker is dropped and changes nothing.

    def _emit(self, text: str) -> None:
        """Queue text on the current channel, merging with the previous piece."""
        if not self._in_thought and self._strip_answer_space:
            text = text.lstrip()
            if text:
                self._strip_answer_space = False
        if not text:
            return
        channel = THINKING if self._in_thought else ANSWER
        if self._out and self._out[-1][0] == channel:
            self._out[-1] = (channel, self._out[-1][1] + text)
        else:
            self._out.append((channel, text))

    def _take(self) -> list[tuple[str, str]]:
        """Hand over the queued pieces."""
        out, self._out = self._out, []
        return out


def split_thinking(text: str) -> tuple[str, str]:
    """Split a whole model output into (answer, thinking)."""
    cleaner = MarkupCleaner()
    parts: dict[str, list[str]] = {ANSWER: [], THINKING: []}
    for channel, piece in cleaner.feed(text) + cleaner.flush():
        parts[channel].append(piece)
    return "".join(parts[ANSWER]), "".join(parts[THINKING])
