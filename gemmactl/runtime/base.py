"""The backend protocol and the one streaming generation core every consumer uses.

`stream_generate` yields `Piece`s (answer or thinking text, markup already removed) as the model
produces them, then one final `GenerationStats`. `run`, `serve` and `bench` consume the same
stream (through gemmactl/generate.py), so all three report the same numbers.
"""

from __future__ import annotations

import math
import resource
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Iterator, Protocol

from gemmactl.errors import EmptyPromptError, InvalidOptionError, PromptTooLongError
from gemmactl.prompt.build import ModelText, build_prompt, user_messages
from gemmactl.prompt.markup import MarkupCleaner
from gemmactl.prompt.stops import StopMatcher


@dataclass(frozen=True)
class Sampling:
    """Sampling settings and their defaults: a recipe tier's, and any request's that sets none."""

    temperature: float = 1.0
    top_k: int = 64
    top_p: float = 0.95
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    max_tokens: int = 512


DEFAULTS = Sampling()
# Tokens the repeat penalty looks back over, prompt included (llama.cpp's repeat_last_n default).
REPEAT_LAST_N = 64


@dataclass(frozen=True)
class GenerationRequest:
    """What to generate: the user's text (or a whole conversation) and the sampling settings.

    The request checks its own values when it is made, so a request that exists is valid; each
    boundary (CLI flags, HTTP fields) checks its input first, in its own words.
    """

    prompt: str  # the user's (last) text
    max_tokens: int = DEFAULTS.max_tokens
    temperature: float = DEFAULTS.temperature
    top_k: int = DEFAULTS.top_k
    top_p: float = DEFAULTS.top_p
    min_p: float = DEFAULTS.min_p
    repeat_penalty: float = DEFAULTS.repeat_penalty
    seed: int | None = None
    thinking: bool = False
    raw: bool = False  # send the prompt as is: no chat template, no question frame
    system: str | None = None
    messages: tuple[dict, ...] | None = None  # a whole conversation (serve); None: the prompt alone
    stops: tuple[str, ...] = ()  # the caller's stop strings, besides the prompt mode's
    whole: bool = False  # the caller takes the answer at once: a backend may make it in one piece

    def __post_init__(self) -> None:
        if not self.prompt.strip():
            raise EmptyPromptError("the prompt is empty")
        texts = [("the prompt", self.prompt), ("the system text", self.system or "")]
        texts += [(f"message {i + 1}", str(m.get("content") or "")) for i, m in enumerate(self.messages or ())]
        for what, text in texts:
            problem = text_problem(text)
            if problem:
                raise InvalidOptionError(f"{what} is not valid text: {problem}",
                                         hint="Send UTF-8 text (a file of another encoding needs converting first).")
        checks = (
            ("max_tokens", self.max_tokens >= 1, "at least 1"),
            ("temperature", _finite(self.temperature) and self.temperature >= 0, "a finite number, 0 or more"),
            ("top_k", self.top_k >= 0, "0 or more"),
            ("top_p", _finite(self.top_p) and 0 <= self.top_p <= 1, "between 0 and 1"),
            ("min_p", _finite(self.min_p) and 0 <= self.min_p <= 1, "between 0 and 1"),
            ("repeat_penalty", _finite(self.repeat_penalty) and self.repeat_penalty >= 0, "a finite number, 0 or more"),
        )
        for name, ok, expected in checks:
            if not ok:
                raise InvalidOptionError(f"{name} must be {expected}, got {getattr(self, name)}")

    def conversation(self) -> list[dict]:
        """The messages the prompt is built from: the conversation, or the system text and the prompt."""
        return list(self.messages) if self.messages is not None else user_messages(self.prompt, self.system)

    @classmethod
    def from_sampling(cls, prompt: str, sampling: Sampling, **changes) -> "GenerationRequest":
        """A request with a recipe tier's sampling settings, changed where the caller says (None keeps them)."""
        values = {**asdict(sampling), **{key: value for key, value in changes.items() if value is not None}}
        return cls(prompt=prompt, **values)


def text_problem(text: str) -> str | None:
    """Why text cannot go to a model, or None: the one rule for every way text comes in.

    Bytes that were not UTF-8 (decoded with surrogateescape, as Python does for stdin and
    arguments) and lone surrogates (which JSON can carry) have no UTF-8 form; NUL ends C strings.
    """
    for index, char in enumerate(text):
        code = ord(char)
        if 0xDC80 <= code <= 0xDCFF:
            return f"byte 0x{code - 0xDC00:02x} at character {index} is not UTF-8"
        if 0xD800 <= code <= 0xDFFF:
            return f"a lone surrogate (U+{code:04X}) at character {index}"
        if code == 0:
            return f"a NUL character at character {index}"
    return None


def _finite(value: float) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


@dataclass(frozen=True)
class GpuPlacement:
    """Where llama.cpp puts a model's layers: all on the GPU, a plan's split, or all on the CPU."""

    applied: bool  # True when the model does not fit the GPU whole and the plan's split is used
    reason: str  # one line for --stats and logs
    n_gpu_layers: int  # llama.cpp -ngl; -1 (all) when it fits, 0 without a usable GPU
    tensor_overrides: tuple[str, ...] = ()  # llama.cpp -ot values
    server_args: tuple[str, ...] = ()  # the llama-server flags this implies
    rpc: tuple[str, ...] = ()  # RPC workers (HOST:PORT) holding some of the layers (--rpc)

    @classmethod
    def all_on_gpu(cls, reason: str = "every layer offered to the GPU") -> "GpuPlacement":
        return cls(False, reason, -1)

    @property
    def llama_server_args(self) -> tuple[str, ...]:
        """The placement as llama-server flags: the plan's, or -ngl for all (999) or none."""
        if self.server_args:
            return self.server_args
        return ("-ngl", "999" if self.n_gpu_layers < 0 else str(self.n_gpu_layers))


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
    (its text then leaves the string out, `stop_string` names it); None lets the core decide as
    for single tokens.
    """

    text: str
    tokens: int
    stop_reason: str | None = None
    stop_string: str | None = None


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
    prefill_tok_s: float | None  # None when the first token came at once (nothing to measure)
    decode_tok_s: float | None  # decode only: tokens after the first ÷ time after the first; None under 2 tokens
    wall_s: float  # request start → last token
    wall_tok_s: float  # generated tokens ÷ wall_s
    peak_rss_bytes: int
    stop_reason: str  # "eos", "length" or "stop"
    prompt_mode: str
    engine_decode_tok_s: float | None = None  # the engine's own decode timer, when it has one
    stop_string: str | None = None  # the stop string that ended the answer (stop_reason "stop")
    extra: dict = field(default_factory=dict)

    def why_empty(self) -> str:
        """Why an answer came out empty, in words: what ended it, after how many tokens."""
        tokens = f"after {self.generated_tokens} token{'s' if self.generated_tokens != 1 else ''}"
        if self.stop_reason == "stop":
            return f"the model wrote the stop string {self.stop_string!r} {tokens}" if self.stop_string else \
                f"a stop string ended it {tokens}"
        if self.stop_reason == "length":
            return f"it reached the token limit {tokens} without visible text"
        return f"the model ended its answer {tokens}"

    def to_dict(self) -> dict:
        return asdict(self)


class Backend(Protocol):
    """An inference engine holding one loaded model: what every caller may use, and nothing else."""

    name: str
    model_path: str
    load_s: float
    context_size: int
    threads: int | None  # CPU threads it decodes with, when it uses the CPU
    library: str | None  # which llama.cpp library it runs, for llama.cpp backends
    placement: GpuPlacement | None  # where its layers are, when a plan placed them
    notices: list[str]  # things the user should know about how it was loaded

    def model_text(self) -> ModelText:
        """The model's chat template and special token texts (what prompt building needs)."""

    def tokenize(self, text: str, *, add_bos: bool, special: bool) -> list[int]:
        """Token ids of text; special: turn markers become control tokens."""

    def prepare(self, request: GenerationRequest) -> PreparedPrompt:
        """Turn the request into prompt tokens (chat template, question frame or raw)."""

    def generate(self, prompt: PreparedPrompt, request: GenerationRequest) -> Iterator[str | Chunk]:
        """Yield the decoded text of each generated token (may be ""), or Chunks; at most max_tokens."""

    def engine_timings(self) -> EngineTimings | None:
        """Timings of the last generation as the engine measured them, if it can."""

    def describe(self) -> dict:
        """What it chose beyond the fields above (kernels, placement, memory): for --stats, --json
        and bench; {} when there is nothing more to say."""

    def close(self) -> None:
        """Free the model."""


class PromptedBackend:
    """The one `prepare` every backend shares: the prompt builder, then the backend's own tokenizer."""

    threads: int | None = None
    library: str | None = None
    placement: GpuPlacement | None = None
    notices: list[str] = []

    def describe(self) -> dict:
        return {}

    def prepare(self, request: GenerationRequest) -> PreparedPrompt:
        built = build_prompt(request.conversation(), self.model_text(), thinking=request.thinking, raw=request.raw)
        tokens = self.tokenize(built.text, add_bos=built.add_bos, special=built.special)
        return PreparedPrompt(tokens=tokens, mode=built.mode, stops=built.stops + request.stops, text=built.text)


def peak_rss_bytes(pid: int | str = "self") -> int | None:
    """Peak resident memory of a process (this one by default) since it started its program.

    Linux's VmHWM, not getrusage's ru_maxrss: the kernel carries ru_maxrss across exec, so a
    worker started by a large parent would report the parent's peak as its own.
    """
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if pid != "self":
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


def stream_generate(backend: Backend, request: GenerationRequest) -> Iterator[Piece | GenerationStats]:
    """Generate from a loaded backend: yield `Piece`s as they come, then a `GenerationStats`."""
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
    stop_reason, stop_string = "eos", None
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
            stop_string = text.stop_string or stop_string
            text = text.text
        else:
            n_generated += 1
        visible, stopped = stopper.feed(text)
        for channel, piece in cleaner.feed(visible):
            yield Piece(piece, channel)
        if stopped:
            stop_reason, stop_string = "stop", stopper.matched
            break
        if n_generated >= max_tokens:
            stop_reason = "length"
            break
    if not stopper.stopped:
        for channel, piece in cleaner.feed(stopper.flush()):
            yield Piece(piece, channel)
    for channel, piece in cleaner.flush():
        yield Piece(piece, channel)
    stats = _stats(backend, prompt, n_prompt, n_generated, start, first_token_at, last_token_at, stop_reason, chunked)
    stats.stop_string = stop_string if stop_reason == "stop" else None
    yield stats


def _stats(backend, prompt, n_prompt, n_generated, start, first_at, last_at, stop_reason,
           chunked: bool = False) -> GenerationStats:
    first_at = first_at if first_at is not None else last_at
    ttft = first_at - start
    wall = last_at - start
    decode_time = last_at - first_at
    engine = backend.engine_timings()
    engine_decode = None
    # A rate needs something to measure: one generated token is prefill's, not decode's.
    if engine and engine.decode_s > 0 and engine.decode_tokens > 1:
        engine_decode = engine.decode_tokens / engine.decode_s
    decode = (n_generated - 1) / decode_time if n_generated > 1 and decode_time > 0 else None
    if chunked:
        # The tokens arrived together: "first token" is the whole answer (what the caller waited
        # for), and only the engine knows how fast it decoded them.
        decode = engine_decode
    return GenerationStats(
        load_s=backend.load_s,
        ttft_s=ttft,
        prompt_tokens=n_prompt,
        generated_tokens=n_generated,
        prefill_tok_s=n_prompt / ttft if ttft > 0 else None,
        # The first token comes out of prefill; decode speed counts the tokens after it.
        decode_tok_s=decode,
        wall_s=wall,
        wall_tok_s=n_generated / wall if wall > 0 else 0.0,
        peak_rss_bytes=peak_rss_bytes(),
        stop_reason=stop_reason,
        prompt_mode=prompt.mode,
        engine_decode_tok_s=engine_decode,
    )
