"""Chat text handling: thinking/answer separation, stop strings, and chat templates."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gemmactl.errors import BackendError

ANSWER = "answer"
THINKING = "thinking"

# Gemma 4 writes "<|channel>thought\n...<channel|>"; other models write "<think>...</think>".
GEMMA_OPEN = "<|channel>thought"
OPEN_MARKERS = (GEMMA_OPEN, "<think>")
CLOSE_MARKERS = ("<channel|>", "</think>")
ALL_MARKERS = OPEN_MARKERS + CLOSE_MARKERS


def _holdback_start(buf: str, patterns: Sequence[str]) -> int:
    """Index where the longest suffix of buf that begins some pattern starts (len(buf) if none)."""
    longest = max((len(p) for p in patterns), default=0)
    for start in range(max(0, len(buf) - longest + 1), len(buf)):
        tail = buf[start:]
        if any(p.startswith(tail) for p in patterns):
            return start
    return len(buf)


def _earliest(buf: str, patterns: Sequence[str]) -> tuple[int, str] | None:
    """The pattern occurrence in buf that ends first (ties: starts first), or None."""
    best: tuple[int, int, str] | None = None
    for pattern in patterns:
        index = buf.find(pattern)
        if index >= 0:
            key = (index + len(pattern), index, pattern)
            if best is None or key < best:
                best = key
    return None if best is None else (best[1], best[2])


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
            found = _earliest(self._buf, ALL_MARKERS)
            if found is None:
                break
            index, marker = found
            self._emit(self._buf[:index])
            self._buf = self._buf[index + len(marker) :]
            self._on_marker(marker)
        # A marker may still be arriving: keep back only the part that could begin one.
        start = _holdback_start(self._buf, ALL_MARKERS)
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


class StopMatcher:
    """Cuts a text stream at the first stop string, holding back possible partial matches."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._buf = ""
        self._stopped = False

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
        found = _earliest(self._buf, self._stops)
        if found is not None:
            out = self._buf[: found[0]]
            self._buf = ""
            self._stopped = True
            return out, True
        start = _holdback_start(self._buf, self._stops)
        out, self._buf = self._buf[:start], self._buf[start:]
        return out, False

    def flush(self) -> str:
        """Release held-back text at the end of the stream."""
        out, self._buf = self._buf, ""
        return "" if self._stopped else out


def render_chat_template(
    template: str,
    messages: list[dict],
    *,
    bos_token: str,
    eos_token: str,
    add_generation_prompt: bool = True,
    enable_thinking: bool = False,
) -> str:
    """Render a GGUF chat template (Jinja2, sandboxed) for the given messages."""
    # Imported here so that commands which never render a template start fast.
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: Any) -> None:
        raise BackendError(f"the model's chat template rejected the conversation: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(
            messages=messages,
            bos_token=bos_token,
            eos_token=eos_token,
            add_generation_prompt=add_generation_prompt,
            enable_thinking=enable_thinking,
        )
    # The template is code from the model file, so any failure inside it is the model's.
    except (TemplateError, TypeError, ValueError, LookupError, ArithmeticError) as exc:
        raise BackendError(f"the model's chat template failed: {exc}") from exc
