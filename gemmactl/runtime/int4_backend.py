"""The "int4" backend: an int4-stream artifact run by a transformers model.

The model is built with empty (meta) parameters from the config in the artifact's index. Its
weights then either become dense parameters, dequantized once at load (`weights="dense"`: the
fastest decoding, the CPU default), or stay packed and are dequantized at every call
(`weights="packed"`, gemmactl/runtime/int4_packed.py: a load that reads almost nothing and, on
a GPU, about a third of the memory; the GPU default). Both give the same logits, bit for bit.
Generation is a plain token-by-token loop over the model's KV cache.
"""

from __future__ import annotations

import inspect
import time
from pathlib import Path
from typing import Iterator

from gemmactl.errors import BackendError
from gemmactl.prompt.build import ModelText
from gemmactl.runtime.base import REPEAT_LAST_N, EngineTimings, GenerationRequest, PreparedPrompt, PromptedBackend

DEBUG_HINT = "Rerun with --debug for details."
_DETOKENIZE_CONTEXT = 4  # prompt tokens decoded with the first new token, so its leading space survives


class IncrementalDetokenizer:
    """Turns one token at a time into text, holding back bytes until they form whole characters."""

    def __init__(self, tokenizer, context: list[int]):
        self.tokenizer = tokenizer
        self.ids = list(context)
        self.prefix = 0  # start of the window decoded each step
        self.read = len(self.ids)  # tokens before this were already emitted as text

    def feed(self, token: int) -> str:
        self.ids.append(token)
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix : self.read], skip_special_tokens=True)
        after = decode(self.ids[self.prefix :], skip_special_tokens=True)
        # A trailing U+FFFD is a character cut in half by a token boundary: wait for the rest.
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before) :]
        return ""


WEIGHTS = ("auto", "dense", "packed")


def resolve_device(device: str | None) -> str:
    """"auto"/None → cuda when torch sees a GPU, else cpu; anything else as given."""
    import torch

    if device in (None, "", "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def open_runnable_artifact(model_path):
    """An int4-stream artifact that carries its tokenizer (both int4 backends need one)."""
    from gemmactl.formats.int4.reader import open_artifact

    artifact = open_artifact(Path(model_path))
    if not artifact.index.get("tokenizer"):
        raise BackendError(
            f"{model_path} has no tokenizer files",
            hint="Quantize a checkpoint that includes its tokenizer (tokenizer.json, tokenizer_config.json).",
        )
    return artifact


class HfTokenizerText(PromptedBackend):
    """Prompt text and tokens from a transformers tokenizer (`self.tokenizer`, `self.chat_template`):
    the int4 artifacts' backends, the engine and the transformers path, share them."""

    tokenizer = None
    chat_template: str | None = None

    def model_text(self) -> ModelText:
        tok = self.tokenizer
        return ModelText(self.chat_template, tok.bos_token or "", tok.eos_token or "")

    def tokenize(self, text: str, *, add_bos: bool, special: bool) -> list[int]:
        # The tokenizer always parses special tokens in text; add_bos decides the BOS token alone.
        tok = self.tokenizer
        tokens = tok(text, add_special_tokens=False)["input_ids"]
        return [tok.bos_token_id, *tokens] if add_bos and tok.bos_token_id is not None else tokens


class Int4Backend(HfTokenizerText):
    """One int4-stream artifact in a transformers model, generating token by token.

    weights: "dense" (dequantize once at load), "packed" (keep packed, dequantize per call) or
    "auto" (packed on a GPU, dense on the CPU); environment GEMMACTL_INT4_WEIGHTS overrides
    "auto". device: "auto" (a GPU when torch sees one) or a torch device; environment
    GEMMACTL_INT4_DEVICE overrides "auto".
    """

    name = "int4"

    def __init__(
        self,
        model_path: str,
        *,
        context_size: int = 4096,
        n_threads: int | None = None,
        dtype=None,
        weights: str = "auto",
        device: str = "auto",
    ):
        """Load the artifact; dtype is the compute dtype (default: the model config's, bfloat16 for
        Gemma: on the CPU it decoded as fast as float32 in half the memory, benchmarks/int4_decode_dtype.py)."""
        import os

        import torch
        from transformers import AutoTokenizer

        from gemmactl.runtime.int4_model import build_model
        from gemmactl.runtime.int4_packed import build_packed_model
        from gemmactl.runtime.llamacpp import default_threads

        self.model_path = str(model_path)
        self.threads = n_threads or default_threads()
        torch.set_num_threads(self.threads)
        if device == "auto":
            device = os.environ.get("GEMMACTL_INT4_DEVICE") or "auto"
        self.device = resolve_device(device)
        if weights == "auto":
            weights = os.environ.get("GEMMACTL_INT4_WEIGHTS") or "auto"
        if weights not in WEIGHTS:
            raise BackendError(f"unknown int4 weights mode {weights!r}", hint="Use dense, packed or auto.")
        self.weights = ("packed" if self.device != "cpu" else "dense") if weights == "auto" else weights
        start = time.perf_counter()
        artifact = open_runnable_artifact(model_path)
        build = build_packed_model if self.weights == "packed" else build_model
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
            self.model = build(artifact, dtype, device=self.device)
        except (OSError, ValueError, KeyError) as exc:
            raise BackendError(f"could not load {model_path}: {exc}", hint=DEBUG_HINT) from exc
        except RuntimeError as exc:  # e.g. no such device, out of device memory
            raise BackendError(f"could not load {model_path} on {self.device}: {exc}", hint=DEBUG_HINT) from exc
        self.load_s = time.perf_counter() - start
        limit = getattr(self.model.config, "max_position_embeddings", None) or context_size
        self.context_size = min(context_size, limit)
        self.chat_template = getattr(self.tokenizer, "chat_template", None) or None
        self.stop_ids = self._stop_ids()
        # transformers 5.24 renamed `past_key_values` to `cache` (argument and output); older ones lack it.
        self._cache_arg = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"

    # -- Backend protocol (model_text and tokenize: HfTokenizerText) -------------------------------

    def generate(self, prompt: PreparedPrompt, request: GenerationRequest) -> Iterator[str]:
        """Yield each new token's text; stop at an end-of-generation token or max_tokens."""
        import torch

        generator = torch.Generator().manual_seed(request.seed if request.seed is not None else int(time.time_ns() % 2**63))
        detok = IncrementalDetokenizer(self.tokenizer, prompt.tokens[-_DETOKENIZE_CONTEXT:])
        history = list(prompt.tokens)
        step_input = torch.tensor([prompt.tokens], device=self.device)  # [1, T] prompt first, then [1, 1] per step
        cache = None
        with torch.inference_mode():
            for _ in range(request.max_tokens):
                try:
                    out = self.model(input_ids=step_input, use_cache=True, **{self._cache_arg: cache})
                except RuntimeError as exc:
                    raise BackendError(f"the model failed while generating: {exc}", hint=DEBUG_HINT) from exc
                cache = out[self._cache_arg] if self._cache_arg in out else out.past_key_values
                logits = out.logits[0, -1].float().cpu()  # [V]
                token = sample_token(logits, history, request, generator)
                if token in self.stop_ids:
                    return
                history.append(token)
                yield detok.feed(token)
                step_input = torch.tensor([[token]], device=self.device)

    def engine_timings(self) -> EngineTimings | None:
        return None

    def close(self) -> None:
        self.model = None

    def _stop_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (self.model.config, getattr(self.model, "generation_config", None), self.tokenizer):
            value = getattr(source, "eos_token_id", None)
            ids.update(value if isinstance(value, (list, tuple)) else [value] if value is not None else [])
        end_of_turn = self.tokenizer.convert_tokens_to_ids("<end_of_turn>")
        if isinstance(end_of_turn, int) and end_of_turn != self.tokenizer.unk_token_id:
            ids.add(end_of_turn)
        return ids


def sample_token(logits, history: list[int], request: GenerationRequest, generator) -> int:
    """Pick the next token from [V] logits: greedy at temperature 0, else penalty → top-k → top-p → min-p."""
    import torch

    if request.repeat_penalty != 1.0 and history:
        # The last REPEAT_LAST_N tokens, prompt included, as llama.cpp's penalty sees them.
        seen = torch.tensor(sorted(set(history[-REPEAT_LAST_N:])))
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / request.repeat_penalty, values * request.repeat_penalty)
    if request.temperature == 0:
        return int(torch.argmax(logits))
    logits = logits / request.temperature
    if request.top_k > 0:
        kth = torch.topk(logits, min(request.top_k, logits.numel())).values[-1]
        logits[logits < kth] = float("-inf")
    probs = torch.softmax(logits, dim=-1)
    if 0 < request.top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = torch.cumsum(sorted_probs, 0) - sorted_probs >= request.top_p
        probs[order[drop]] = 0
    if request.min_p > 0:
        probs[probs < request.min_p * probs.max()] = 0
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))
