"""What bench measures: gemmactl's streaming core, and the alternatives it is compared with.

Every target loads the same model with the same settings (context, threads, greedy) and
returns a `Sample` timed the same way: request start → first token → last token.
Cache modes for a request: "off" (start from an empty cache), "fill" (start cold, keep the
result for the next request), "reuse" (use what the previous request left, if the target can).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from gemmactl.bench.stats import RequestTiming, acceptance_rate, request_metrics
from gemmactl.errors import ServerError
from gemmactl.runtime.base import GenerationRequest, GenerationStats, peak_rss_bytes, stream_generate

COMPARE_TARGETS = ("llama-cpp-python", "llama-server", "hf-generate", "accelerate")
OURS = "gemmactl"
WARMUP_TOKENS = 4  # one untimed request after loading: first-call allocations are not what users wait for
IN_PROCESS_NOTE = "peak RSS of the bench process, shared by every in-process target"


class TargetUnavailable(Exception):
    """This target cannot run here; the message says why (it is skipped, not an error)."""


@dataclass
class TargetSettings:
    """The settings every target uses, so that they measure the same work."""

    model_path: str
    is_gguf: bool
    context: int
    threads: int
    extra_buffers: bool
    n_gpu_layers: int
    log_dir: Path
    tensor_overrides: tuple[str, ...] = ()  # llama.cpp -ot values of gemmactl's placement
    placement_args: tuple[str, ...] = ()  # the same placement as llama-server flags
    server_binary: Path | None = None
    hf_model: Path | None = None
    vram_bytes: int | None = None
    speculative_args: tuple[str, ...] = ()  # llama-server's draft-model flags (--draft); empty: no speculation


@dataclass
class Sample:
    """One measured generation."""

    metrics: dict
    text: str
    timing: RequestTiming | None = None
    engine_decode_tok_s: float | None = None
    cached_tokens: int | None = None
    extra: dict = field(default_factory=dict)


@dataclass
class ServerReply:
    """One streamed completion: its timing, text and the server's own counters."""

    timing: RequestTiming
    text: str
    final: dict = field(default_factory=dict)

    @property
    def cached_tokens(self) -> int:
        return int(self.final.get("timings", {}).get("cache_n", 0))

    @property
    def engine_decode_tok_s(self) -> float | None:
        return self.final.get("timings", {}).get("predicted_per_second")

    @property
    def draft_tokens(self) -> int:
        """Tokens the draft model proposed for this request (speculative decoding; 0 without it)."""
        return int(self.final.get("timings", {}).get("draft_n", 0))

    @property
    def draft_accepted(self) -> int:
        """Of those, the tokens the model accepted."""
        return int(self.final.get("timings", {}).get("draft_n_accepted", 0))


def complete(server, prompt: str, max_tokens: int, *, cache_prompt: bool, timeout: float = 300) -> ServerReply:
    """One greedy completion streamed from a LlamaServer, timed as the core times it: request start →
    first and last token events."""
    if not server.alive():
        raise ServerError("llama-server is not running", hint=f"See its log: {server.log_path}")
    payload = {"prompt": prompt, "n_predict": max_tokens, "cache_prompt": cache_prompt, "seed": 0,
               **server.sampling_fields(0, 0, 1.0, 0.0, 1.0)}
    pieces: list[str] = []
    first = last = None
    final: dict = {}
    start = time.perf_counter()
    for event in server.stream(payload, timeout=timeout):
        now = time.perf_counter()
        pieces.append(event.get("content", ""))
        if event.get("stop"):
            final = event
            break
        # One event per generated token (its text may be "" while a character is incomplete).
        first = first if first is not None else now
        last = now
    generated = int(final.get("tokens_predicted", 0))
    timing = RequestTiming(start, first, last, int(final.get("tokens_evaluated", 0)), generated)
    return ServerReply(timing, "".join(pieces), final)


class GemmactlTarget:
    """gemmactl's one streaming core (stop matcher and markup cleaner included), as `run` uses it."""

    name = OURS
    prefix_reuse = False
    note = (
        "in process every generation starts from an empty KV cache (llama-cpp-python's prefix reuse "
        "is wrong on Gemma's sliding-window cache), so warm = cold by design"
    )

    def __init__(self, backend, request: GenerationRequest):
        self.backend = backend
        self.request = request
        self.load_s = backend.load_s

    def generate(self, prompt: str, max_tokens: int, cache: str = "off") -> Sample:
        request = replace(self.request, prompt=prompt, max_tokens=max_tokens)
        text, stats = [], None
        for event in stream_generate(self.backend, request):
            if isinstance(event, GenerationStats):
                stats = event
            else:
                text.append(event.text)
        # Rates with nothing to measure are 0.0 here, as bench's own arithmetic has them (stats.py).
        metrics = {key: getattr(stats, key) for key in (
            "ttft_s", "wall_s", "prompt_tokens", "generated_tokens", "prefill_tok_s", "decode_tok_s", "wall_tok_s")}
        metrics = {key: 0.0 if value is None else value for key, value in metrics.items()}
        return Sample(metrics, "".join(text), engine_decode_tok_s=stats.engine_decode_tok_s, cached_tokens=0)

    def memory(self) -> dict:
        return {"peak_rss_bytes": peak_rss_bytes(), "memory_scope": IN_PROCESS_NOTE}

    def info(self) -> dict:
        return {"backend": self.backend.name, "library": self.backend.library, "threads": self.backend.threads,
                "context": self.backend.context_size, **self.backend.describe()}

    def close(self) -> None:
        self.backend.close()


class LlamaCppPythonTarget:
    """Raw `Llama.create_completion(stream=True)` on the same GGUF and settings."""

    name = "llama-cpp-python"
    prefix_reuse = True
    note = "llama-cpp-python's own prefix reuse (no reset before the warm request)"

    def __init__(self, settings: TargetSettings):
        if not settings.is_gguf:
            raise TargetUnavailable("llama-cpp-python runs GGUF files; this model is not one")
        import llama_cpp

        from gemmactl.runtime.llamacpp import model_param_fields, override_model_params

        start = time.perf_counter()
        # Same extra-buffer choice and placement as gemmactl: the library's default segfaults on AMX CPUs.
        fields, self._keep = model_param_fields(llama_cpp, settings.extra_buffers, settings.tensor_overrides)
        with override_model_params(llama_cpp, **fields):
            self.llm = llama_cpp.Llama(
                model_path=settings.model_path, n_ctx=settings.context, n_gpu_layers=settings.n_gpu_layers,
                n_threads=settings.threads, n_threads_batch=settings.threads, verbose=False,
            )
        self.load_s = time.perf_counter() - start
        self.version = llama_cpp.__version__

    def generate(self, prompt: str, max_tokens: int, cache: str = "off") -> Sample:
        llm = self.llm
        tokens = llm.tokenize(prompt.encode("utf-8"), special=True)  # as create_completion does
        cached = 0
        if cache == "reuse":
            held = list(llm.input_ids[: llm.n_tokens])
            while cached < min(len(held), len(tokens)) and held[cached] == tokens[cached]:
                cached += 1
            cached = min(cached, len(tokens) - 1)  # the last prompt token is always evaluated again
        else:
            llm.reset()
        text, finish = [], None
        start = time.perf_counter()
        first = last = None
        for chunk in llm.create_completion(prompt, max_tokens=max_tokens, temperature=0.0, stream=True):
            last = time.perf_counter()
            first = first if first is not None else last
            choice = chunk["choices"][0]
            text.append(choice["text"])
            finish = choice.get("finish_reason") or finish
        # Streaming gives no usage: the context holds prompt + every generated token except the last
        # one when it stopped at max_tokens (sampled, never evaluated); an end token is not counted.
        generated = llm.n_tokens - len(tokens) + (1 if finish == "length" else 0)
        timing = RequestTiming(start, first, last, len(tokens), generated)
        return Sample(request_metrics(timing), "".join(text), timing, cached_tokens=cached)

    def memory(self) -> dict:
        return {"peak_rss_bytes": peak_rss_bytes(), "memory_scope": IN_PROCESS_NOTE}

    def info(self) -> dict:
        return {"llama_cpp_python": self.version, "threads": self.llm.context_params.n_threads,
                "context": self.llm.n_ctx()}

    def close(self) -> None:
        self.llm.close()


class LlamaServerTarget:
    """The active build's llama-server on 127.0.0.1, over real HTTP, streaming `/completion`."""

    name = "llama-server"
    prefix_reuse = True
    note = "llama-server's prompt cache (cache_prompt)"

    def __init__(self, settings: TargetSettings, parallel: int = 1):
        from gemmactl.llamacpp.server import LlamaServer

        if not settings.is_gguf:
            raise TargetUnavailable("llama-server runs GGUF files; this model is not one")
        if settings.server_binary is None:
            raise TargetUnavailable("no llama.cpp build with llama-server: run `gemmactl build` first")
        self.server = LlamaServer(
            settings.server_binary, settings.model_path, threads=settings.threads, context=settings.context,
            parallel=parallel, n_gpu_layers=settings.n_gpu_layers if settings.n_gpu_layers >= 0 else 999,
            placement=settings.placement_args or None,
            repack=settings.extra_buffers, log_dir=settings.log_dir, extra_args=settings.speculative_args,
        )
        self.speculative = bool(settings.speculative_args)
        self.server.__enter__()
        self.load_s = self.server.load_s

    def generate(self, prompt: str, max_tokens: int, cache: str = "off", timeout: float = 300) -> Sample:
        reply = complete(self.server, prompt, max_tokens, cache_prompt=cache != "off", timeout=timeout)
        extra = {}
        if self.speculative:
            extra = {"draft_tokens": reply.draft_tokens, "draft_accepted": reply.draft_accepted,
                     "acceptance_rate": acceptance_rate(reply.draft_tokens, reply.draft_accepted)}
        return Sample(
            request_metrics(reply.timing), reply.text, reply.timing,
            engine_decode_tok_s=reply.engine_decode_tok_s, cached_tokens=reply.cached_tokens, extra=extra,
        )

    def memory(self) -> dict:
        return {"peak_rss_bytes": self.server.peak_rss_bytes(), "memory_scope": "peak RSS of the llama-server process"}

    def info(self) -> dict:
        info = {"command": self.server.command, "log": str(self.server.log_path), "parallel": self.server.parallel,
                "pid": self.server.pid}
        if not self.speculative:
            return info
        refused = self.server.speculation_refused()
        return {**info, "speculative": f"refused by llama-server: {refused}" if refused else True}

    def close(self) -> None:
        self.server.__exit__(None, None, None)


class _TimingStreamer:
    """A transformers streamer that records when each generated token arrives."""

    def __init__(self):
        self.prompt_seen = False
        self.times: list[float] = []

    def put(self, value) -> None:
        if not self.prompt_seen:  # generate() first hands over the prompt ids
            self.prompt_seen = True
            return
        now = time.perf_counter()
        self.times.extend([now] * int(value.numel()))

    def end(self) -> None:
        pass


class HfGenerateTarget:
    """transformers `generate` with a streamer, greedy, on a Hugging Face checkpoint of the same model."""

    name = "hf-generate"
    prefix_reuse = False
    note = "transformers generate recomputes the prompt every time"

    def __init__(self, settings: TargetSettings):
        if settings.hf_model is None:
            raise TargetUnavailable(
                "hf-generate needs a Hugging Face checkpoint of the same model: pass --hf-model DIR "
                "(or pull one into the store with the same source as the GGUF)"
            )
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        torch.set_num_threads(settings.threads)
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        start = time.perf_counter()
        self.tokenizer = AutoTokenizer.from_pretrained(str(settings.hf_model))
        self.model = self._load(AutoModelForCausalLM, settings)
        self.load_s = time.perf_counter() - start
        self.versions = {"torch": torch.__version__, "transformers": __import__("transformers").__version__}

    def _load(self, auto, settings: TargetSettings):
        model = auto.from_pretrained(str(settings.hf_model), dtype="auto")
        return model.to(self.device).eval()

    def generate(self, prompt: str, max_tokens: int, cache: str = "off") -> Sample:
        torch = self.torch
        inputs = self.tokenizer(prompt, return_tensors="pt").to(self.model.device)
        n_prompt = int(inputs["input_ids"].shape[1])
        streamer = _TimingStreamer()
        start = time.perf_counter()
        with torch.inference_mode():
            output = self.model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False, streamer=streamer)
        new = output[0, n_prompt:].tolist()
        eos = self.model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        while new and new[-1] in eos:  # an end token is not a generated token for the others either
            new.pop()
        times = streamer.times[: len(new)] or [None]
        timing = RequestTiming(start, times[0], times[-1], n_prompt, len(new))
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        return Sample(request_metrics(timing), text, timing)

    def memory(self) -> dict:
        memory = {"peak_rss_bytes": peak_rss_bytes(), "memory_scope": IN_PROCESS_NOTE}
        if self.device == "cuda":
            memory["peak_gpu_bytes"] = int(self.torch.cuda.max_memory_allocated())
        return memory

    def info(self) -> dict:
        return {"checkpoint": str(getattr(self.model, "name_or_path", "")), "device": self.device, **self.versions}

    def close(self) -> None:
        del self.model


class AccelerateTarget(HfGenerateTarget):
    """The same as hf-generate, placed by accelerate's device_map="auto" under a VRAM cap."""

    name = "accelerate"
    note = "device_map=\"auto\" under the VRAM cap; what it placed on the GPU is recorded"

    def __init__(self, settings: TargetSettings):
        import torch

        if not torch.cuda.is_available():
            raise TargetUnavailable("accelerate's device_map=\"auto\" under a VRAM cap needs a CUDA GPU; none is visible")
        super().__init__(settings)

    def _load(self, auto, settings: TargetSettings):
        torch = self.torch
        cap = settings.vram_bytes or torch.cuda.get_device_properties(0).total_memory
        self.cap = cap
        torch.cuda.reset_peak_memory_stats()
        model = auto.from_pretrained(
            str(settings.hf_model), dtype="auto", device_map="auto",
            max_memory={0: cap, "cpu": 1 << 40},
        )
        return model.eval()

    def info(self) -> dict:
        placement: dict[str, int] = {}
        for device in getattr(self.model, "hf_device_map", {}).values():
            placement[str(device)] = placement.get(str(device), 0) + 1
        return {**super().info(), "vram_cap_bytes": self.cap, "modules_per_device": placement}


COMPARE_CLASSES = {
    "llama-cpp-python": LlamaCppPythonTarget,
    "llama-server": LlamaServerTarget,
    "hf-generate": HfGenerateTarget,
    "accelerate": AccelerateTarget,
}

# Targets that import torch run in a worker process (see gemmactl/bench/isolated.py).
ISOLATED = {"hf-generate": "HfGenerateTarget", "accelerate": "AccelerateTarget"}
