"""The warm backends behind the front: a persistent llama-server per GGUF model, or a model in process.

Both hand out per-request sessions that satisfy the `Backend` protocol, so every answer goes
through the one streaming core (`runtime.base.stream_generate`) that `run` uses: same stop
strings, same thinking cleanup, same stats.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gemmactl.errors import BackendError, ServerError
from gemmactl.formats.gguf_header import read_gguf_header
from gemmactl.prompt.build import ModelText
from gemmactl.runtime.base import Chunk, EngineTimings, GenerationRequest, PreparedPrompt, PromptedBackend

log = logging.getLogger("gemmactl.serve")

READY, STARTING, RESTARTING, FAILED, STOPPED = "ready", "starting", "restarting", "failed", "stopped"
RESTART_DELAYS = (0.0, 1.0, 2.0, 5.0, 10.0)  # seconds before each restart attempt; then the backend is failed
# A non-streamed answer: this many seconds, plus one per token asked for (the streamed path
# allows 300 s between two tokens).
WHOLE_ANSWER_TIMEOUT_S = 300


class BackendDown(ServerError):
    """The tier's llama-server is not running right now (it died; the watchdog restarts it)."""


@dataclass
class BackendInfo:
    """What `ps`, /health and /metrics say about a backend."""

    kind: str  # "llama-server", "in-process llamacpp", "in-process int4"
    model_path: str
    tiers: list[str]
    parallel: int
    context: int
    placement: str = ""
    speculative: str = "off"
    command: list[str] = field(default_factory=list)


class ServerBackend:
    """A llama-server child for one GGUF and settings, restarted when it dies; shared by its tiers.

    `flash_attn` is the tiers' recipe `flash_attn` (llama-server `-fa`: off, on or auto).
    """

    kind = "llama-server"

    def __init__(
        self,
        binary: Path,
        model_path: Path,
        *,
        tiers: Sequence[str],
        context: int,
        parallel: int,
        threads: int,
        log_dir: Path,
        placement: Sequence[str] | None = None,
        placement_note: str = "",
        extra_args: Sequence[str] = (),
        speculative: str = "off",
        flash_attn: str = "off",
        on_change: Callable[[], None] | None = None,
    ):
        from gemmactl.llamacpp.server import LlamaServer

        self._make = lambda: LlamaServer(
            binary, str(model_path), threads=threads, context=context, parallel=parallel, log_dir=log_dir,
            placement=placement, extra_args=extra_args, label="-".join(tiers), flash_attn=flash_attn,
        )
        self.server = self._make()
        self.model_path = str(model_path)
        self.context = context
        self.parallel = parallel
        self.slots = threading.Semaphore(parallel)
        self.state = STARTING
        self.restarts = 0
        self.load_s = 0.0
        self.model_text: ModelText | None = None
        self.info = BackendInfo(self.kind, self.model_path, list(tiers), parallel, context, placement_note,
                                speculative, list(self.server.command))
        self._on_change = on_change or (lambda: None)
        self._stopping = threading.Event()
        self._watchdog: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        return self.server.pid

    @property
    def url(self) -> str:
        return self.server.url

    def start(self) -> None:
        """Start the process, read its special tokens and the model's template, then watch it."""
        self._start_once()
        self.state = READY
        self._watchdog = threading.Thread(target=self._watch, name=f"watch-{self.info.tiers[0]}", daemon=True)
        self._watchdog.start()

    def _start_once(self) -> None:
        self.load_s = self.server.start()
        props = self.server.get_json("/props")
        # llama-server reports a fallback template for a model that has none: whether the model has
        # its own chat template comes from the file.
        template = read_gguf_header(Path(self.model_path), tensors=False).metadata.get("tokenizer.chat_template")
        self.model_text = ModelText(str(template) if template else None, props.get("bos_token", ""),
                                    props.get("eos_token", ""))
        self.info.command = list(self.server.command)
        refused = self.server.speculation_refused()
        if refused:
            # Said wherever the tier is shown (startup line, ps, /metrics), not "on" with 0 drafted.
            self.info.speculative = f"refused by llama-server: {refused}"
            log.warning("tiers %s: llama-server turned down speculative decoding (%s); decoding without it",
                        ", ".join(self.info.tiers), refused)

    def _watch(self) -> None:
        while not self._stopping.wait(0.2):
            if self.state != READY or self.server.alive():
                continue
            code = self.server.process.returncode if self.server.process else None
            log.warning("llama-server for %s exited (code %s); restarting it", ", ".join(self.info.tiers), code)
            self.state = RESTARTING
            self._on_change()
            for delay in RESTART_DELAYS:
                if self._stopping.wait(delay):
                    return
                try:
                    self.server.stop()
                    self.server = self._make()
                    self._start_once()
                except ServerError as exc:
                    log.warning("restarting llama-server for %s failed: %s", ", ".join(self.info.tiers), exc)
                    continue
                self.restarts += 1
                self.state = READY
                log.info("llama-server for %s is back (pid %s, %.1f s)", ", ".join(self.info.tiers),
                         self.server.pid, self.load_s)
                break
            else:
                self.state = FAILED
                log.error("llama-server for %s could not be restarted; see %s", ", ".join(self.info.tiers),
                          self.server.log_path)
            self._on_change()

    def stop(self) -> None:
        self._stopping.set()
        if self._watchdog is not None:
            self._watchdog.join(timeout=15)
        self.server.stop()
        self.state = STOPPED

    def session(self) -> "ServerSession":
        return ServerSession(self)


class ServerSession(PromptedBackend):
    """One request against a ServerBackend, shaped as a `Backend` for `stream_generate`."""

    name = "llama-server"

    def __init__(self, backend: ServerBackend):
        self.backend = backend
        self.server = backend.server  # the process of this request, even if a restart replaces it
        self.model_path = backend.model_path
        self.load_s = backend.load_s
        self.context_size = backend.context
        self.final: dict = {}

    def model_text(self) -> ModelText:
        return self.backend.model_text

    def tokenize(self, text: str, *, add_bos: bool, special: bool) -> list[int]:
        # Tokenized by the server itself, with the flags the in-process backend uses.
        return self.server.post_json("/tokenize", {"content": text, "add_special": add_bos,
                                                   "parse_special": special})["tokens"]

    def prepare(self, request: GenerationRequest) -> PreparedPrompt:
        tiers = "/".join(self.backend.info.tiers)
        if self.backend.state != READY:
            raise BackendDown(f"the backend of tier {tiers} is {self.backend.state}")
        if not self.server.alive():  # died since the watchdog last looked: it restarts it shortly
            raise BackendDown(f"the llama-server of tier {tiers} stopped and is restarting")
        try:
            return super().prepare(request)
        except ServerError:
            if not self.server.alive():
                raise BackendDown(f"the llama-server of tier {tiers} stopped and is restarting") from None
            raise

    def generate(self, prompt: PreparedPrompt, request: GenerationRequest) -> Iterator[str | Chunk]:
        # A stop made only of whitespace applies only once the answer has begun (prompt/stops.py),
        # which llama-server cannot do: such a prompt streams, and the core stops it.
        if request.whole and all(stop.strip() for stop in prompt.stops):
            yield self._whole(prompt, request)
            return
        # Timings on every event: the core may stop reading before the final one (max_tokens, a stop).
        for event in self.server.stream(self._payload(prompt, request) | {"timings_per_token": True}):
            self.final = event
            if event.get("stop"):
                if event.get("content"):
                    yield event["content"]
                return
            yield event.get("content", "")

    def _whole(self, prompt: PreparedPrompt, request: GenerationRequest) -> Chunk:
        """The answer in one non-streamed /completion: llama-server sends no event per token and
        stops at the prompt's stop strings itself (its text leaves them out)."""
        payload = self._payload(prompt, request) | {"stop": list(prompt.stops)}
        # No event arrives before the end: allow the whole answer's time, as the streamed path allows per token.
        self.final = self.server.post_json("/completion", payload, timeout=WHOLE_ANSWER_TIMEOUT_S + request.max_tokens)
        stopped = self.final.get("stop_type") == "word"
        return Chunk(self.final.get("content", ""), int(self.final.get("tokens_predicted", 0)),
                     "stop" if stopped else None, self.final.get("stopping_word") or None if stopped else None)

    def _payload(self, prompt: PreparedPrompt, request: GenerationRequest) -> dict:
        return {
            "prompt": prompt.tokens, "n_predict": request.max_tokens, "cache_prompt": True,
            "seed": -1 if request.seed is None else request.seed,
            **self.server.sampling_fields(request.temperature, request.top_k, request.top_p, request.min_p,
                                          request.repeat_penalty),
        }

    def engine_timings(self) -> EngineTimings | None:
        timings = self.final.get("timings")
        if not timings:
            return None
        return EngineTimings(timings.get("prompt_ms", 0) / 1000, int(timings.get("prompt_n", 0)),
                             timings.get("predicted_ms", 0) / 1000, int(timings.get("predicted_n", 0)))

    def counters(self) -> dict:
        """Prompt-cache and speculative counters of the finished request."""
        timings = self.final.get("timings", {})
        return {"cached_tokens": int(timings.get("cache_n", 0)), "draft_tokens": int(timings.get("draft_n", 0)),
                "draft_accepted": int(timings.get("draft_n_accepted", 0))}

    def close(self) -> None:
        pass


class InProcessBackend:
    """A model loaded in this process (llama-cpp-python or the int4 runtime): one request at a time."""

    def __init__(self, loaded, *, tiers: Sequence[str], context: int, note: str = ""):
        self.loaded = loaded
        self.kind = f"in-process {loaded.name}"
        self.model_path = loaded.model_path
        self.context = loaded.context_size
        self.parallel = 1
        self.slots = threading.Semaphore(1)
        self.state = READY
        self.restarts = 0
        self.load_s = loaded.load_s
        self.pid = None
        self.url = None
        self.info = BackendInfo(self.kind, self.model_path, list(tiers), 1, context, note)

    def start(self) -> None:
        pass

    def stop(self) -> None:
        self.state = STOPPED
        self.loaded.close()

    def session(self) -> "InProcessSession":
        return InProcessSession(self)


class InProcessSession(PromptedBackend):
    """One request against an InProcessBackend, shaped as a `Backend` for `stream_generate`."""

    def __init__(self, backend: InProcessBackend):
        self.backend = backend
        self.loaded = backend.loaded
        self.name = self.loaded.name
        self.model_path = backend.model_path
        self.load_s = backend.load_s
        self.context_size = backend.context

    def model_text(self) -> ModelText:
        return self.loaded.model_text()

    def tokenize(self, text: str, *, add_bos: bool, special: bool) -> list[int]:
        return self.loaded.tokenize(text, add_bos=add_bos, special=special)

    def prepare(self, request: GenerationRequest) -> PreparedPrompt:
        if self.backend.state != READY:
            raise BackendError(f"the in-process backend is {self.backend.state}")
        return super().prepare(request)

    def generate(self, prompt: PreparedPrompt, request: GenerationRequest) -> Iterator[str]:
        return self.loaded.generate(prompt, request)

    def engine_timings(self) -> EngineTimings | None:
        return self.loaded.engine_timings()

    def counters(self) -> dict:
        # Every in-process generation starts from an empty cache (prefix reuse is wrong on Gemma there).
        return {"cached_tokens": 0, "draft_tokens": 0, "draft_accepted": 0}

    def close(self) -> None:
        pass


def wait_ready(backends: Sequence, timeout: float) -> bool:
    """Whether every backend is ready within timeout seconds (for tests and `serve` start-up)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(b.state == READY for b in backends):
            return True
        time.sleep(0.05)
    return False
