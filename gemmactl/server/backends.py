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

from gemmactl.errors import BackendError, GemmactlError, ServerError
from gemmactl.llamacpp.draft_tuner import server_args
from gemmactl.llamacpp.served import ServerGeneration, model_text_of
from gemmactl.prompt.build import ModelText
from gemmactl.runtime.base import EngineTimings, GenerationRequest, PreparedPrompt, PromptedBackend

log = logging.getLogger("gemmactl.serve")

READY, STARTING, RESTARTING, FAILED, STOPPED = "ready", "starting", "restarting", "failed", "stopped"
RESTART_DELAYS = (0.0, 1.0, 2.0, 5.0, 10.0)  # seconds before each restart attempt; then the backend is failed


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
        draft_args: Sequence[str] = (),
        draft_tuner=None,
        flash_attn: str = "off",
        on_change: Callable[[], None] | None = None,
        replan: Callable[[], tuple[Sequence[str], str]] | None = None,
    ):
        from gemmactl.llamacpp.server import LlamaServer

        # replan: the placement again before a restart (RPC workers that are gone are left out).
        self._placement, self._replan = placement, replan
        # draft_args: the speculative flags, as draft_tuner (llamacpp/draft_tuner.py) has them now: the
        # recipe's, a shorter draft, or none; switching restarts the server between answers.
        self.draft_tuner = draft_tuner
        self._make = lambda: LlamaServer(
            binary, str(model_path), threads=threads, context=context, parallel=parallel, log_dir=log_dir,
            placement=self._placement, label="-".join(tiers), flash_attn=flash_attn,
            extra_args=(tuple(draft_args) if draft_tuner is None else server_args(tuple(draft_args), draft_tuner.length))
            + tuple(extra_args),
        )
        # () → the tuner's decision and figures, for the lane's snapshot and /metrics
        self.speculation = draft_tuner.summary if draft_tuner is not None else None
        self._tuning = threading.Lock()  # the tuner's figures
        self._switching = threading.Lock()  # held while a draft switch or the watchdog replaces the server
        self._switcher: threading.Thread | None = None
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
        self.model_text = model_text_of(self.server, self.model_path)
        self.info.command = list(self.server.command)
        refused = self.server.speculation_refused()
        if refused:
            # Said wherever the tier is shown (startup line, ps, /metrics), not "on" with 0 drafted.
            self.info.speculative = f"refused by llama-server: {refused}"
            log.warning("tiers %s: llama-server turned down speculative decoding (%s); decoding without it",
                        ", ".join(self.info.tiers), refused)

    def answered(self, stats, counters: dict | None) -> None:
        """A finished answer of this server: the draft tuner's measurement. Where it says to switch,
        the server restarts in the tuner's configuration once the answers in flight are done (new
        ones wait for a slot meanwhile), on a thread of its own. `_switching` is held by that
        thread, or by the watchdog restarting a dead server: one replaces the server at a time."""
        tuner = self.draft_tuner
        if tuner is None or stats is None or self.state != READY or self.info.speculative.startswith("refused"):
            return
        counters = counters or {}
        with self._tuning:
            if not self._switching.acquire(blocking=False):  # an answer of a server being replaced
                return
            started = False
            try:
                if tuner.record(stats.generated_tokens, stats.decode_tok_s, counters.get("draft_tokens", 0),
                                counters.get("draft_accepted", 0)):
                    self._switcher = threading.Thread(target=self._switch_draft, name=f"draft-{self.info.tiers[0]}",
                                                      daemon=True)
                    self._switcher.start()
                    started = True  # the thread releases _switching
            finally:
                if not started:
                    self._switching.release()

    def _switch_draft(self) -> None:
        held = 0
        try:
            try:
                while held < self.parallel:  # every slot: the answers in flight finish first
                    if self._stopping.is_set():
                        return
                    if self.slots.acquire(timeout=0.5):
                        held += 1
                tuner = self.draft_tuner
                log.info("tiers %s: restarting llama-server %s (decode tok/s measured: %s)", ", ".join(self.info.tiers),
                         f"with drafts of up to {tuner.length}" if tuner.length else
                         "with its draft" if tuner.drafting else "without its draft", tuner.summary()["decode_tok_s"])
                self.server.stop()
                if self._stopping.is_set():
                    return
                self.server = self._make()
                try:
                    self._start_once()
                except (ServerError, GemmactlError) as exc:  # dead: the watchdog's restarts take over
                    log.warning("restarting llama-server for %s failed: %s", ", ".join(self.info.tiers), exc)
                    return
                if self._stopping.is_set():  # stop() came while it started: it must not outlive us
                    self.server.stop()
                    return
                self._on_change()
            finally:
                for _ in range(held):
                    self.slots.release()
        finally:
            self._switching.release()

    def _watch(self) -> None:
        while not self._stopping.wait(0.2):
            if self.state != READY or self.server.alive():
                continue
            if not self._switching.acquire(blocking=False):  # a draft switch is replacing the server
                continue
            try:
                self._restart()
            finally:
                self._switching.release()

    def _restart(self) -> None:
        code = self.server.process.returncode if self.server.process else None
        log.warning("llama-server for %s exited (code %s); restarting it", ", ".join(self.info.tiers), code)
        self.state = RESTARTING
        self._on_change()
        for delay in RESTART_DELAYS:
            if self._stopping.wait(delay):
                return
            try:
                self.server.stop()
                if self._replan is not None:
                    self._placement, self.info.placement = self._replan()
                self.server = self._make()
                self._start_once()
            except (ServerError, GemmactlError) as exc:
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
        if self._switcher is not None:
            self._switcher.join(timeout=60)
        self.server.stop()
        self.state = STOPPED

    def session(self, client_gone: Callable[[], bool] | None = None) -> "ServerSession":
        return ServerSession(self, client_gone)


class ServerSession(ServerGeneration):
    """One request against a ServerBackend, shaped as a `Backend` for `stream_generate`."""

    name = "llama-server"

    def __init__(self, backend: ServerBackend, client_gone: Callable[[], bool] | None = None):
        self.backend = backend
        self.server = backend.server  # the process of this request, even if a restart replaces it
        self.client_gone = client_gone  # a whole answer is abandoned (and its slot freed) once this says so
        self.model_path = backend.model_path
        self.load_s = backend.load_s
        self.context_size = backend.context
        self.final: dict = {}

    def model_text(self) -> ModelText:
        return self.backend.model_text

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
        speculator = getattr(loaded, "speculator", None)
        self.speculation = None  # () → the tuner's decision and figures, for the lane's snapshot and /metrics
        if speculator is not None:
            tuner = speculator.tuner
            self.info.speculative = (f"engine draft {speculator.draft_path}, "
                                     f"{'tuned' if tuner.fixed is None else 'fixed'} k≤{tuner.k_max}")
            self.speculation = tuner.summary

    def start(self) -> None:
        pass

    def stop(self) -> None:
        self.state = STOPPED
        self.loaded.close()

    def session(self, client_gone: Callable[[], bool] | None = None) -> "InProcessSession":
        # Token by token: the front checks its client between tokens itself.
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
        # The engine's speculation reports the last generation's drafts (one request at a time here).
        speculator = getattr(self.loaded, "speculator", None)
        stats = speculator.stats if speculator is not None else None
        return {"cached_tokens": 0, "draft_tokens": stats.drafted if stats else 0,
                "draft_accepted": stats.kept if stats else 0}

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
