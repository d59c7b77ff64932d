"""The backend protocol and the one streaming generation core every consumer uses.

`stream_generate` yields `Piece`s (answer or thinking text, markup already removed) as the model
produces them, then one final `GenerationStats`. `run` consumes it now; `serve` and `bench` consume
the same stream, so all three report the same numbers.
"""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Iterator, Protocol

from gemmactl.chat import MarkupCleaner, StopMatcher
from gemmactl.errors import EmptyPromptError, InvalidOptionError, PromptTooLongError


@dataclass(frozen=True)
class GenerationRequest:
    """What to generate: the user's text and the sampling settings."""

    prompt: str
    max_tokens: int = 256
    temperature: float = 0.7
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    seed: int | None = None
    thinking: bool = False
    raw: bool = False  # send the prompt as is: no chat template, no question frame
    system: str | None = None


@dataclass(frozen=True)
class PreparedPrompt:
    """The prompt as the backend will feed it: token ids, how it was built, where to stop."""

    tokens: list[int]
    mode: str  # "chat-template", "question-frame" or "completion"
    stops: tuple[str, ...] = ()
    text: str = ""


@dataclass(frozen=True)
class Chunk:
    """Several generated tokens at once, from a backend that makes a whole answer in one call.

    `stop_reason` is "stop" when the engine itself stopped at one of the prompt's stop strings
    (its text then leaves the string out); None lets the core decide as for single tokens.
    """

    text: str
    tokens: int
    stop_reason: str | None = None


@dataclass(frozen=True)
class EngineTimings:
    """Timings measured inside the inference engine (no Python overhead)."""

    prefill_s: float
    prefill_tokens: int
    decode_s: float
    decode_tokens: int


@dataclass(frozen=True)
class Piece:
    """A piece of streamed text on one channel: "answer" or "thinking"."""

    text: str
    channel: str = "answer"


@dataclass
class GenerationStats:
    """Speed and memory of one generation; wall figures are what a caller waits for."""

    load_s: float
    ttft_s: float  # request start → first generated token
    prompt_tokens: int
    generated_tokens: int
    prefill_tok_s: float
    decode_tok_s: float  # decode only: tokens after the first ÷ time after the first
    wall_s: float  # request start → last token
    wall_tok_s: float  # generated tokens ÷ wall_s
    peak_rss_bytes: int
    stop_reason: str  # "eos", "length" or "stop"
    prompt_mode: str
    engine_decode_tok_s: float | None = None  # the engine's own decode timer, when it has one
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


class Backend(Protocol):
    """An inference engine holding one loaded model."""

    name: str
    model_path: str
    load_s: float
    context_size: int

    def prepare(self, request: GenerationRequest) -> PreparedPrompt:
        """Turn the request into prompt tokens (chat template, question frame or raw)."""

    def generate(self, prompt: PreparedPrompt, request: GenerationRequest) -> Iterator[str | Chunk]:
        """Yield the decoded text of each generated token (may be ""), or Chunks; at most max_tokens."""

    def engine_timings(self) -> EngineTimings | None:
        """Timings of the last generation as the engine measured them, if it can."""

    def close(self) -> None:
        """Free the model."""


def peak_rss_bytes() -> int:
    """Peak resident memory of this process so far."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


def check_request(request: GenerationRequest) -> None:
    """Refuse settings no backend can honour, before any work is done."""
    if not request.prompt.strip():
        raise EmptyPromptError("the prompt is empty")
    if request.max_tokens < 1:
        raise InvalidOptionError(f"--max-tokens must be at least 1, got {request.max_tokens}")
    if request.temperature < 0:
        raise InvalidOptionError(f"--temperature must be 0 or more, got {request.temperature}")


def stream_generate(backend: Backend, request: GenerationRequest) -> Iterator[Piece | GenerationStats]:
    """Generate from a loaded backend: yield `Piece`s as they come, then a `GenerationStats`."""
    check_request(request)
    start = time.perf_counter()
    prompt = backend.prepare(request)
    n_prompt = len(prompt.tokens)
    if n_prompt >= backend.context_size:
        raise PromptTooLongError(
            f"the prompt is {n_prompt} tokens but the context holds {backend.context_size}",
            hint="Shorten the prompt, or raise the tier's `context` in the recipe.",
        )
    # Never ask for more tokens than the context has room for.
    max_tokens = min(request.max_tokens, backend.context_size - n_prompt)
    if max_tokens != request.max_tokens:
        request = replace(request, max_tokens=max_tokens)

    stopper = StopMatcher(prompt.stops)
    cleaner = MarkupCleaner()
    first_token_at: float | None = None
    last_token_at = start
    n_generated = 0
    stop_reason = "eos"
    chunked = False  # some tokens came together: no per-token timing for them
    for text in backend.generate(prompt, request):
        now = time.perf_counter()
        if first_token_at is None:
            first_token_at = now
        last_token_at = now
        if isinstance(text, Chunk):
            chunked = True
            n_generated += text.tokens
            stop_reason = text.stop_reason or stop_reason
            text = text.text
        else:
            n_generated += 1
        visible, stopped = stopper.feed(text)
        for channel, piece in cleaner.feed(visible):
            yield Piece(piece, channel)
        if stopped:
            stop_reason = "stop"
            break
        if n_generated >= max_tokens:
            stop_reason = "length"
            break
    if not stopper.stopped:
        for channel, piece in cleaner.feed(stopper.flush()):
            yield Piece(piece, channel)
    for channel, piece in cleaner.flush():
        yield Piece(piece, channel)
    yield _stats(backend, prompt, n_prompt, n_generated, start, first_token_at, last_token_at, stop_reason, chunked)


def _stats(backend, prompt, n_prompt, n_generated, start, first_at, last_at, stop_reason,
           chunked: bool = False) -> GenerationStats:
    first_at = first_at if first_at is not None else last_at
    ttft = first_at - start
    wall = last_at - start
    decode_time = last_at - first_at
    engine = backend.engine_timings()
    engine_decode = None
    if engine and engine.decode_s > 0 and engine.decode_tokens > 0:
        engine_decode = engine.decode_tokens / engine.decode_s
    decode = (n_generated - 1) / decode_time if n_generated > 1 and decode_time > 0 else 0.0
    if chunked:
        # The tokens arrived together: "first token" is the whole answer (what the caller waited
        # for), and only the engine knows how fast it decoded them.
        decode = engine_decode or 0.0
    return GenerationStats(
        load_s=backend.load_s,
        ttft_s=ttft,
        prompt_tokens=n_prompt,
        generated_tokens=n_generated,
        prefill_tok_s=n_prompt / ttft if ttft > 0 else 0.0,
        # The first token comes out of prefill; decode speed counts the tokens after it.
        decode_tok_s=decode,
        wall_s=wall,
        wall_tok_s=n_generated / wall if wall > 0 else 0.0,
        peak_rss_bytes=peak_rss_bytes(),
        stop_reason=stop_reason,
        prompt_mode=prompt.mode,
        engine_decode_tok_s=engine_decode,
    )
