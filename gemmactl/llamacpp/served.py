"""Generation through a llama-server: the part every user of one shares, and a Backend that owns one.

`ServerGeneration` turns a prepared prompt into llama-server /completion calls (streamed, or one
whole answer when the stops allow it) and reads its timings; `serve` uses it per request
(server/backends.py). `ServedBackend` is a llama-server child of this process behind the Backend
protocol: the generation path opens one for a GGUF split across RPC workers, where llama.cpp
aborts the whole process on a broken worker connection: a child that dies is an error to show,
not this process gone without a word.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

from gemmactl.errors import ServerError
from gemmactl.formats.gguf_header import read_gguf_header
from gemmactl.prompt.build import ModelText
from gemmactl.runtime.base import Chunk, EngineTimings, GenerationRequest, PreparedPrompt, PromptedBackend

# A non-streamed answer: this many seconds, plus one per token asked for (the streamed path
# allows 300 s between two tokens).
WHOLE_ANSWER_TIMEOUT_S = 300


class ServerGeneration(PromptedBackend):
    """Tokenize and generate with `self.server` (a LlamaServer); `self.final` is its last answer."""

    server = None
    client_gone: Callable[[], bool] | None = None  # a whole answer is abandoned (slot freed) once this says so
    final: dict = {}

    def tokenize(self, text: str, *, add_bos: bool, special: bool) -> list[int]:
        # Tokenized by the server itself, with the flags the in-process backend uses.
        return self.server.post_json("/tokenize", {"content": text, "add_special": add_bos,
                                                   "parse_special": special})["tokens"]

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
        self.final = self.server.post_json("/completion", payload, timeout=WHOLE_ANSWER_TIMEOUT_S + request.max_tokens,
                                           cancelled=self.client_gone)
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


def model_text_of(server, model_path: str) -> ModelText:
    """The model's chat template (from the file: llama-server reports a fallback for a model with
    none) and the special tokens llama-server reports."""
    props = server.get_json("/props")
    template = read_gguf_header(Path(model_path), tensors=False).metadata.get("tokenizer.chat_template")
    return ModelText(str(template) if template else None, props.get("bos_token", ""), props.get("eos_token", ""))


class ServedBackend(ServerGeneration):
    """A GGUF run by a llama-server child of this process (one slot), stopped on close."""

    name = "llama-server"

    def __init__(self, binary: Path, model_path: str, *, context_size: int, n_threads: int, log_dir: Path,
                 placement=None, library: str | None = None, kv_cache: str | None = None):
        from gemmactl.llamacpp.server import LlamaServer

        self.model_path = str(model_path)
        self.placement = placement
        self.library = library
        self.threads = n_threads
        self.notices = []
        self.final = {}
        quantized = kv_cache not in (None, "f16")
        self.server = LlamaServer(binary, self.model_path, threads=n_threads, context=context_size, log_dir=log_dir,
                                  placement=placement.llama_server_args if placement is not None else None,
                                  extra_args=("-ctk", kv_cache, "-ctv", kv_cache) if kv_cache else (),
                                  flash_attn="on" if quantized else "off", label="run")
        try:
            self.load_s = self.server.start()
        except ServerError as exc:
            if placement is not None and placement.rpc:
                raise ServerError(f"{exc.message} (the split across {', '.join(placement.rpc)}: a worker that "
                                  "stopped or ran out of its --mem ends llama-server)", hint=exc.hint) from None
            raise
        try:
            self._model_text = model_text_of(self.server, self.model_path)
        except BaseException:
            self.server.stop()
            raise
        self.context_size = context_size

    def model_text(self) -> ModelText:
        return self._model_text

    def close(self) -> None:
        self.server.stop()
