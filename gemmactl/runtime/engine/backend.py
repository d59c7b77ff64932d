"""The `int4` backend: an int4-stream artifact run by the engine.

Prefill runs in chunks of CHUNK tokens (CPU_CHUNK on the CPU) with batched matmuls; decode runs
one token per step (a replayed CUDA graph on a GPU) and picks the next token on the device, so
only its id reaches the host. Timings come from the engine itself (synchronized at prefill's end and decode's end).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Iterator

from gemmactl.errors import BackendError
from gemmactl.runtime.base import REPEAT_LAST_N, EngineTimings, GenerationRequest, PreparedPrompt
from gemmactl.runtime.int4_backend import HfTokenizerText, open_runnable_artifact

CHUNK = 256  # prefill tokens per step (the GPU plan's working area is sized for it)
# On the CPU a chunk is longer: past 64 tokens the CPU kernels' products decode the stored codes
# once per chunk (runtime/engine/cpu_kernels.py), so a 510-token prompt on Gemma 3 270M took 0.60 s
# in two chunks against 0.28 s with dense weights. The attention's query rows still go in bounded
# blocks (spec.score_rows), and a ring cache keeps a chunk's last window (kv.py).
CPU_CHUNK = 1024
DEVICE_ENV = "GEMMACTL_INT4_DEVICE"  # auto | cpu | cuda[:N]
DTYPE_ENV = "GEMMACTL_ENGINE_DTYPE"  # bfloat16 (default) | float32
DEBUG_HINT = "Rerun with --debug for details."
_DETOKENIZE_CONTEXT = 4  # prompt tokens decoded with the first new token, so its leading space survives


def engine_device(device: str | None = None) -> str:
    """"auto"/None → cuda when torch sees a GPU, else cpu ($GEMMACTL_INT4_DEVICE first)."""
    import torch

    device = device if device not in (None, "", "auto") else (os.environ.get(DEVICE_ENV) or "auto")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise BackendError(f"{DEVICE_ENV}={device} asks for CUDA, and torch sees no CUDA GPU here",
                           hint="Unset it (or set cpu): the CPU runs the same engine.")
    return device


def engine_dtype():
    import torch

    # bfloat16 is the checkpoints' dtype and what the GPU kernels take; on the CPU a decode step
    # reads half the bytes of float32 and ran faster (docs/benchmarks.md, engine on the CPU).
    name = os.environ.get(DTYPE_ENV, "bfloat16")
    if name not in ("bfloat16", "float32"):
        raise BackendError(f"{DTYPE_ENV}={name} is not a dtype the engine runs in", hint="Use bfloat16 or float32.")
    return getattr(torch, name)


class EngineBackend(HfTokenizerText):
    """One int4-stream artifact loaded in the engine, generating token by token."""

    name = "int4"

    def __init__(self, model_path: str, *, context_size: int = 4096, n_threads: int | None = None,
                 device: str = "auto", dtype=None, placement=None, experts=None, kv_mode: str | None = None,
                 yarn: float | None = None, draft=None):
        """draft: a DraftSettings (runtime/engine/draft.py) for speculative decoding."""
        import torch
        from transformers import AutoTokenizer

        from gemmactl.runtime.engine.graph import DecodeStep
        from gemmactl.runtime.engine.model import GemmaModel
        from gemmactl.runtime.llamacpp import default_threads

        self.model_path = str(model_path)
        self.threads = n_threads or default_threads()
        torch.set_num_threads(self.threads)
        self.device = engine_device(device)
        self.dtype = dtype or engine_dtype()
        start = time.perf_counter()
        artifact = open_runnable_artifact(model_path)
        limit = int(artifact.config.get("max_position_embeddings") or context_size) * (yarn or 1)
        self.context_size = int(min(context_size, limit))
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
            # A GPU plan's placement; on the CPU every layer is simply there.
            placement = placement if self.device.startswith("cuda") else None
            with torch.inference_mode():
                self.model = GemmaModel(artifact, device=self.device, dtype=self.dtype, context=self.context_size,
                                        placement=placement, experts=experts, kv_mode=kv_mode, yarn=yarn,
                                        spare_slots=draft.k_max if draft is not None else 0)
            self.decoder = DecodeStep(self.model, cache_dir=Path(artifact.path) / "engine-cache" / "inductor")
        except (OSError, ValueError, KeyError) as exc:
            raise BackendError(f"could not load {model_path}: {exc}", hint=DEBUG_HINT) from exc
        except RuntimeError as exc:  # e.g. out of device memory, an unusable kernel
            raise BackendError(f"could not load {model_path} on {self.device}: {exc}", hint=DEBUG_HINT) from exc
        self.load_s = time.perf_counter() - start
        self.chat_template = getattr(self.tokenizer, "chat_template", None) or None
        self.stop_ids = self._stop_ids(artifact.config)
        self._timings: EngineTimings | None = None
        self.notices = []
        if placement is not None and not placement.resident_only:
            self.notices.append(f"{placement.reason or 'placed'}: {placement.summary()}")
        from gemmactl.runtime.engine.graph import moe_table_refused

        refused = moe_table_refused(self.model)
        if refused:
            self.notices.append(refused)
        self.speculator = None
        if draft is not None:
            from gemmactl.runtime.engine.draft import open_speculator

            self.speculator = open_speculator(self, artifact, draft, self.notices)

    def describe(self) -> dict:
        """What the engine chose: device, dtype, kernels, placement, capture, memory."""
        kernels = sorted({lin.kernel for layer in self.model.layers for lin in layer.linears().values()})
        spec = self.speculator
        return {"device": self.device, "dtype": str(self.dtype).removeprefix("torch."), "kernels": kernels,
                "kv_cache": self.model.kv_mode,
                "placement": self.model.placement.summary(), "cuda_graph": self.decoder.graph is not None,
                "compiled": self.decoder.compiled, "setup_s": round(self.decoder.setup_s, 3), **self.model.memory(),
                **({"experts": self.model.experts.stats()} if self.model.experts is not None else {}),
                **({"speculation": {"draft": spec.draft_path, "k_max": spec.tuner.k_max, **spec.tuner.summary(),
                                    **spec.stats.to_dict()}} if spec is not None else {})}

    # -- Backend protocol (model_text and tokenize: HfTokenizerText) -------------------------------

    def generate(self, prompt: PreparedPrompt, request: GenerationRequest) -> Iterator[str]:
        import torch

        from gemmactl.runtime.engine.sampler import pick
        from gemmactl.runtime.int4_backend import IncrementalDetokenizer

        model, device = self.model, self.model.device
        generator = None
        if request.temperature > 0:
            generator = torch.Generator(device=device)
            generator.manual_seed(request.seed if request.seed is not None else int(time.time_ns() % 2**63))
        detok = IncrementalDetokenizer(self.tokenizer, prompt.tokens[-_DETOKENIZE_CONTEXT:])
        recent = torch.tensor(prompt.tokens[-REPEAT_LAST_N:], dtype=torch.long, device=device)
        n = len(prompt.tokens)
        self._timings = None
        try:
            with torch.inference_mode():
                start = time.perf_counter()
                model.reset()
                tokens = torch.tensor(prompt.tokens, dtype=torch.long, device=device)
                chunk = CHUNK if device.type == "cuda" else CPU_CHUNK
                for begin in range(0, n, chunk):
                    stop = min(n, begin + chunk)
                    logits = model.step(tokens[begin:stop], torch.arange(begin, stop, device=device), stop)
                speculator = self.speculator
                if speculator is not None:  # the draft reads the prompt when first asked to draft
                    speculator.begin(list(prompt.tokens), chunk)
                    speculator = speculator if speculator.speculates(request) else None
                token = pick(logits, recent, request, generator)
                first = int(token)  # waits for prefill: its time is TTFT's
                prefill_s = time.perf_counter() - start
                decode_start, decoded = time.perf_counter(), 0
                position = n
                value = first
                drafted = None  # the speculator's tokens, when there is a draft
                while True:
                    if value in self.stop_ids:
                        break
                    yield detok.feed(value)
                    decoded += 1
                    if position >= self.context_size or decoded >= request.max_tokens:
                        break
                    if speculator is not None:
                        if drafted is None:
                            drafted = speculator.tokens(value, position, list(prompt.tokens) + [value], request,
                                                             generator, self.decoder, self.context_size,
                                                             budget=request.max_tokens - decoded)
                        value = next(drafted)
                        position += 1
                        continue
                    recent = torch.cat((recent[1:] if recent.numel() >= REPEAT_LAST_N else recent, token.reshape(1)))
                    logits = self.decoder(token, position)
                    token = pick(logits, recent, request, generator)
                    value = int(token)
                    position += 1
                self._timings = EngineTimings(prefill_s, n, time.perf_counter() - decode_start, max(decoded - 1, 0))
        except RuntimeError as exc:
            raise BackendError(f"the engine failed while generating: {exc}", hint=DEBUG_HINT) from exc

    def engine_timings(self) -> EngineTimings | None:
        return self._timings

    def close(self) -> None:
        self.model = None
        self.decoder = None
        self.speculator = None

    def _stop_ids(self, config: dict) -> set[int]:
        ids: set[int] = set()
        for value in (config.get("eos_token_id"), self.tokenizer.eos_token_id):
            ids.update(value if isinstance(value, (list, tuple)) else [value] if value is not None else [])
        end_of_turn = self.tokenizer.convert_tokens_to_ids("<end_of_turn>")
        if isinstance(end_of_turn, int) and end_of_turn != self.tokenizer.unk_token_id:
            ids.add(end_of_turn)
        return ids


ENGINE_ENV = "GEMMACTL_INT4_ENGINE"  # auto | off (the transformers path, kept as the reference)


def open_int4_backend(model_path: str, **options):
    """The `int4` backend for an artifact: the engine, or transformers when GEMMACTL_INT4_ENGINE=off
    asks for it (the reference path)."""
    if os.environ.get(ENGINE_ENV, "auto").lower() in ("off", "0", "false"):
        from gemmactl.runtime.int4_backend import Int4Backend

        options.pop("placement", None)  # it places nothing: one device for the whole model
        for engine_only in ("experts", "kv_mode", "yarn", "draft"):
            options.pop(engine_only, None)
        return Int4Backend(model_path, **options)
    return EngineBackend(model_path, **options)
