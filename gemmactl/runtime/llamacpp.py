"""The llama.cpp backend: a GGUF model in process through llama-cpp-python."""

from __future__ import annotations

import codecs
import ctypes
import os
import threading
import time
from collections import deque
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from gemmactl.errors import BackendError
from gemmactl.prompt.build import ModelText
from gemmactl.runtime.base import EngineTimings, GenerationRequest, GpuPlacement, PreparedPrompt, PromptedBackend

DEBUG_HINT = "Rerun with --debug for details."
# llama.cpp's "pick a random seed" value.
RANDOM_SEED = 0xFFFFFFFF


def default_threads() -> int:
    """Threads for decode: every core this process may use (llama-cpp-python's default is half)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def use_extra_buffers() -> bool:
    """Whether llama.cpp may repack weights into its extra CPU buffers (repacked and AMX layouts).

    Off unless GEMMACTL_LLAMA_EXTRA_BUFFERS=on. The repacked CPU kernels round differently for
    different batch sizes, so a prompt evaluated partly from a server's cached prefix gave other
    greedy tokens than the whole prompt (9 of 22 plain prompts of the default recipe); without them
    the cached and uncached paths agree, and `run` and `serve` with them. On the 2-core x86 machine
    here they gained nothing on prompts and 6% on decode, within the spread (docs/benchmarks.md). The AMX matmul among them also
    segfaults in llama-cpp-python 0.3.36 on AMX CPUs.
    """
    return os.environ.get("GEMMACTL_LLAMA_EXTRA_BUFFERS", "off").lower() in ("on", "1", "true")


_PARAMS_LOCK = threading.Lock()
_LOG_LINES: deque[str] = deque(maxlen=2000)
_LOG_HANDLER = None  # keeps the ctypes callback alive while llama.cpp holds it


def capture_llama_logs(lib) -> deque[str]:
    """Route llama.cpp's log into a ring buffer instead of stderr (kept for diagnostics)."""
    global _LOG_HANDLER
    if _LOG_HANDLER is None:

        debug = {"last": False}

        def handler(level, text, user_data):
            # ggml levels: 1 info, 2 warn, 3 error, 4 debug, 5 continues the previous line.
            if level == 4 or (level == 5 and debug["last"]):
                debug["last"] = True
                return
            debug["last"] = False
            _LOG_LINES.append(text.decode("utf-8", errors="replace"))

        _LOG_HANDLER = lib.llama_log_callback(handler)
        lib.llama_log_set(_LOG_HANDLER, None)
    return _LOG_LINES


@contextmanager
def override_model_params(lib, **fields):
    """Set model-param fields that llama-cpp-python's Llama() does not take as arguments.

    Llama() builds its params from llama_model_default_params(); wrap that maker while one
    model loads (under a lock, so concurrent loads do not see each other's wrapper).
    """
    module = lib.llama_cpp
    original = module.llama_model_default_params

    def with_fields():
        params = original()
        for name, value in fields.items():
            setattr(params, name, value)
        return params

    with _PARAMS_LOCK:
        module.llama_model_default_params = with_fields
        try:
            yield
        finally:
            module.llama_model_default_params = original


class _BuftOverride(ctypes.Structure):
    # struct llama_model_tensor_buft_override { const char * pattern; ggml_backend_buffer_type_t buft; }
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def cpu_tensor_overrides(lib, overrides) -> ctypes.Array:
    """llama.cpp -ot values ("REGEX=CPU") as the NULL-terminated array llama_model_params takes.

    llama-cpp-python's Llama() has no argument for them, so the array is built here with the
    CPU buffer type looked up in the loaded ggml (only CPU targets are supported).
    """
    base = Path(lib.llama_cpp._base_path)
    ggml = ctypes.CDLL(str(base / "libggml.so"))
    ggml_base = ctypes.CDLL(str(base / "libggml-base.so"))
    ggml.ggml_backend_dev_by_name.restype = ctypes.c_void_p
    ggml.ggml_backend_dev_by_name.argtypes = [ctypes.c_char_p]
    ggml_base.ggml_backend_dev_buffer_type.restype = ctypes.c_void_p
    ggml_base.ggml_backend_dev_buffer_type.argtypes = [ctypes.c_void_p]
    device = ggml.ggml_backend_dev_by_name(b"CPU")
    if not device:
        raise BackendError("llama.cpp has no CPU device to place tensor overrides on", hint=DEBUG_HINT)
    buft = ggml_base.ggml_backend_dev_buffer_type(device)
    entries = []
    for value in overrides:
        pattern, _, target = value.rpartition("=")
        if target.upper() != "CPU" or not pattern:
            raise BackendError(f"tensor override '{value}' is not PATTERN=CPU", hint=DEBUG_HINT)
        entries.append(_BuftOverride(pattern.encode(), buft))
    entries.append(_BuftOverride(None, None))
    return (_BuftOverride * len(entries))(*entries)


def model_param_fields(lib, extra_buffers: bool, tensor_overrides: tuple[str, ...]) -> tuple[dict, object]:
    """(llama_model_params fields for override_model_params, what must stay alive while the model loads)."""
    fields: dict = {"use_extra_bufts": extra_buffers}
    if not tensor_overrides:
        return fields, None
    array = cpu_tensor_overrides(lib, tensor_overrides)
    fields["tensor_buft_overrides"] = ctypes.cast(array, ctypes.c_void_p)
    return fields, array


@contextmanager
def _penalizing_the_prompt(llm, prompt_tokens: list[int]):
    """Let the repeat penalty see the prompt's last tokens, as llama-server's does.

    llama-server feeds every prompt token to its sampler before the first step, so its repeat
    penalty (the last 64 tokens) covers the prompt's end; llama-cpp-python's covers only what it
    generated. With the prompt fed to the sampler llama-cpp-python builds in `generate` (its
    `_init_sampler`, llama-cpp-python 0.3.36), `run` and `serve` pick the same tokens.
    """
    make = llm._init_sampler

    def init_sampler(*args, **kwargs):
        sampler = make(*args, **kwargs)
        for token in prompt_tokens[-llm.last_n_tokens_size:]:  # 64, REPEAT_LAST_N
            sampler.accept(token)
        return sampler

    llm._init_sampler = init_sampler
    try:
        yield
    finally:
        del llm._init_sampler  # back to the class's method


class LlamaCppBackend(PromptedBackend):
    """One GGUF model loaded by llama.cpp, generating token by token.

    n_gpu_layers and tensor_overrides place the layers; placement records where they came from
    (gemmactl/generate.py passes the planner's decision as all three).
    """

    name = "llamacpp"

    def __init__(
        self,
        model_path: str,
        *,
        context_size: int = 4096,
        n_gpu_layers: int = -1,
        n_threads: int | None = None,
        extra_args: dict | None = None,
        library=None,
        tensor_overrides: tuple[str, ...] = (),
        placement: GpuPlacement | None = None,
    ):
        # library: a gemmactl.llamacpp.library.LibraryChoice, applied before llama_cpp is imported.
        self.library = library.label if library else "llama-cpp-python's own"
        self.notices: list[str] = list(library.notices) if library else []
        try:
            import llama_cpp
        except ImportError as exc:  # pragma: no cover - it is a hard dependency
            raise BackendError(
                f"llama-cpp-python is not importable ({exc})",
                hint="Reinstall gemmactl: pip install --force-reinstall llama-cpp-python==0.3.36",
            ) from exc
        self._lib = llama_cpp
        self.model_path = str(model_path)
        self.placement = placement
        capture_llama_logs(llama_cpp)
        threads = n_threads or default_threads()
        self.extra_buffers = use_extra_buffers()
        start = time.perf_counter()
        self.tensor_overrides = tuple(tensor_overrides)
        # The array is kept on self: llama.cpp reads it while the model loads.
        fields, self._overrides_array = model_param_fields(llama_cpp, self.extra_buffers, self.tensor_overrides)
        try:
            with override_model_params(llama_cpp, **fields):
                self._llm = llama_cpp.Llama(
                    model_path=self.model_path,
                    n_ctx=context_size,
                    n_gpu_layers=n_gpu_layers,
                    n_threads=threads,
                    n_threads_batch=threads,
                    seed=RANDOM_SEED,
                    verbose=False,
                    **(extra_args or {}),
                )
        except (ValueError, RuntimeError, OSError) as exc:
            raise BackendError(
                f"llama.cpp could not load {self.model_path}: {exc}",
                hint="Check that the file is a complete GGUF (`gemmactl list` shows its size); "
                "rerun with --debug for details.",
            ) from exc
        self.load_s = time.perf_counter() - start
        self.context_size = self._llm.n_ctx()
        self.threads = threads
        self.metadata = dict(self._llm.metadata)
        self.chat_template = self.metadata.get("tokenizer.chat_template") or None

    # -- Backend protocol ------------------------------------------------------------------------

    def model_text(self) -> ModelText:
        return ModelText(self.chat_template, self._token_text(self._llm.token_bos()),
                         self._token_text(self._llm.token_eos()))

    def tokenize(self, text: str, *, add_bos: bool, special: bool) -> list[int]:
        return self._llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=special)

    def generate(self, prompt: PreparedPrompt, request: GenerationRequest) -> Iterator[str]:
        """Yield each new token's text; stop at an end-of-generation token or max_tokens."""
        llm, lib = self._llm, self._lib
        llm.set_seed(RANDOM_SEED if request.seed is None else request.seed)
        lib.llama_perf_context_reset(llm.ctx)
        vocab = llm._model.vocab
        # Tokens can end mid-character: decode UTF-8 incrementally across tokens.
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # Start from an empty KV cache: llama-cpp-python's prefix reuse trims the cache of a
        # sliding-window (iSWA) model such as Gemma 3 wrongly, and greedy output then differs
        # from a fresh run (tests/test_llamacpp_backend.py shows it).
        llm.reset()
        with _penalizing_the_prompt(llm, prompt.tokens):
            tokens = llm.generate(
                prompt.tokens,
                temp=request.temperature,
                top_k=request.top_k,
                top_p=request.top_p,
                min_p=request.min_p,
                repeat_penalty=request.repeat_penalty,
                reset=True,
            )
            for _ in range(request.max_tokens):
                try:
                    token = next(tokens)
                except StopIteration:
                    return
                except RuntimeError as exc:  # llama_decode failed (e.g. out of KV cache)
                    raise BackendError(f"llama.cpp failed while generating: {exc}", hint=DEBUG_HINT) from exc
                if lib.llama_vocab_is_eog(vocab, token):
                    return
                # An incomplete character at the very end of generation is dropped.
                yield decoder.decode(llm.detokenize([token]))

    def engine_timings(self) -> EngineTimings | None:
        data = self._lib.llama_perf_context(self._llm.ctx)
        return EngineTimings(
            prefill_s=data.t_p_eval_ms / 1000,
            prefill_tokens=data.n_p_eval,
            decode_s=data.t_eval_ms / 1000,
            decode_tokens=data.n_eval,
        )

    def close(self) -> None:
        self._llm.close()

    # -- helpers ---------------------------------------------------------------------------------

    def _token_text(self, token: int) -> str:
        if token < 0:
            return ""
        return self._llm.detokenize([token], special=True).decode("utf-8", errors="replace")
