"""A draft model for the engine's speculative decoding: what a tier asks for, and loading it.

The draft is another int4-stream artifact of the same vocabulary (a smaller Gemma, or the same
model quantized more coarsely), loaded beside the target on the same device. A draft with another
vocabulary is refused, naming both; one larger than the target loads with a warning (the tuner
turns speculation off when it loses); one that fails to load leaves the tier running without
speculation, and says so.
"""

from __future__ import annotations

from dataclasses import dataclass

from gemmactl.errors import GemmactlError, InvalidOptionError

DEFAULT_DRAFT_MAX = 4


@dataclass(frozen=True)
class DraftSettings:
    """A tier's draft: the artifact, the most tokens drafted per round, and whether the tuner
    chooses how many (else always draft_max)."""

    path: str
    k_max: int = DEFAULT_DRAFT_MAX
    tune: bool = True
    problem: str | None = None  # why it cannot be used (found when it was resolved)


def _vocabulary(tokenizer) -> dict:
    return tokenizer.get_vocab()


def _stored_bytes(artifact) -> int:
    return sum(int(record.nbytes) for record in artifact.records)


def open_speculator(backend, artifact, draft: DraftSettings, notices: list[str]):
    """The Speculator for backend's model and the draft, or None (with a notice) when the draft
    cannot be loaded. Raises InvalidOptionError for a draft of another vocabulary."""
    import torch
    from transformers import AutoTokenizer

    from gemmactl.runtime.engine.graph import COMPILE_ENV, DecodeStep, VerifyStep, rows_alone_wanted
    from gemmactl.runtime.engine.graph_host import HostPiecesDecode
    from gemmactl.runtime.engine.model import GemmaModel
    from gemmactl.runtime.engine.speculative import Speculator, Tuner
    from gemmactl.runtime.int4_backend import open_runnable_artifact

    if draft.problem:
        notices.append(f"the draft {draft.path} could not be loaded ({draft.problem}); running without speculation")
        return None
    try:
        draft_artifact = open_runnable_artifact(draft.path)
        draft_tokenizer = AutoTokenizer.from_pretrained(draft.path)
    except Exception as exc:  # noqa: BLE001 - any failure to open leaves the tier without speculation
        notices.append(f"the draft {draft.path} could not be loaded ({_first_line(exc)}); running without speculation")
        return None
    ours, theirs = _vocabulary(backend.tokenizer), _vocabulary(draft_tokenizer)
    if ours != theirs:
        raise InvalidOptionError(
            f"the draft {draft.path} has another vocabulary ({len(theirs):,} tokens) than the model "
            f"{backend.model_path} ({len(ours):,} tokens)",
            hint="A draft must share its target's tokenizer: use a smaller model of the same family.")
    draft_bytes, target_bytes = _stored_bytes(draft_artifact), _stored_bytes(artifact)
    if draft_bytes > target_bytes:
        notices.append(f"the draft {draft.path} ({draft_bytes / 1e9:.2f} GB) is larger than the model "
                       f"({target_bytes / 1e9:.2f} GB): it will rarely pay, and the tuner turns it off when it loses")
    try:
        with torch.inference_mode():
            model = GemmaModel(draft_artifact, device=backend.device, dtype=backend.dtype,
                               context=backend.context_size, spare_slots=draft.k_max,
                               placement=draft_placement(draft_artifact, backend.device))
        step = DecodeStep(model)
    except (GemmactlError, OSError, ValueError, KeyError, RuntimeError) as exc:
        notices.append(f"the draft {draft.path} could not be loaded on {backend.device} ({_first_line(exc)}); "
                       "running without speculation")
        return None
    if model.spec.vocab != backend.model.spec.vocab:  # same tokenizer, another (padded) logits width
        raise InvalidOptionError(
            f"the draft {draft.path} scores {model.spec.vocab:,} tokens and the model {backend.model_path} "
            f"{backend.model.spec.vocab:,}", hint="A draft must share its target's vocabulary and output width.")
    alone = rows_alone_wanted(backend.decoder)
    try:
        with torch.inference_mode():
            verifier = VerifyStep(backend.model, draft.k_max + 1, step=backend.decoder.compiled_step(),
                                  captured=isinstance(backend.decoder.graph, torch.cuda.CUDAGraph),
                                  forward=backend.decoder.fused_forward(), rows_alone=alone,
                                  pieces=isinstance(backend.decoder.graph, HostPiecesDecode))
    except RuntimeError as exc:  # e.g. out of device memory for the verify step's graph
        notices.append(f"the verify step for the draft {draft.path} could not be captured ({_first_line(exc)}); "
                       "verifying eagerly")
        verifier = VerifyStep(backend.model, draft.k_max + 1, captured=False, rows_alone=alone)
    speculator = Speculator(backend.model, model, Tuner(draft.k_max, fixed=None if draft.tune else draft.k_max), step,
                            verifier)
    speculator.draft_path = draft.path
    speculator.greedy_inexact = greedy_inexact(backend.decoder)
    if speculator.greedy_inexact:
        fused = backend.decoder.compiled and backend.model.experts is None  # turning it off would make it exact
        notices.append(f"greedy requests decode without the draft {draft.path}: {speculator.greedy_inexact} "
                       "(sampled requests still speculate"
                       + (f"; {COMPILE_ENV}=off speculates exactly, with a slower step)" if fused else ")"))
    return speculator


INEXACT_SPECULATION_ENV = "GEMMACTL_ENGINE_SPECULATE_INEXACT"  # off (default) | on: greedy speculation there too


def greedy_inexact(decoder) -> str | None:
    """Why greedy speculation beside this DecodeStep would not give plain decoding's tokens bit for
    bit, or None where it does. On a GPU: a step fused by torch.compile (measured not exact on an
    H100: docs/speculation.md), and an MoE model (its verify step's rows routed together through
    the experts' kernels, not measured there). Where INEXACT_SPECULATION_ENV is on it speculates
    there anyway (to measure how far the texts agree)."""
    import os

    if decoder.model.device.type != "cuda" or os.environ.get(INEXACT_SPECULATION_ENV, "off").strip().lower() in (
            "on", "1", "true"):
        return None
    if decoder.model.experts is not None:  # first: unfused, it would still not be
        return "the MoE verify step's rows are not measured bit-exact on a GPU"
    if decoder.compiled:
        return "the model's step is fused on the GPU, where the verify step is not bit-exact"
    return None


def draft_placement(artifact, device: str):
    """On a GPU the draft keeps every layer there and its embedding tables in host memory (only the
    current token's rows cross the link, tens of KB a step; plan/engine_map.draft_gpu_bytes counts
    it so): an E2B draft's tables would take more of a small card than its layers do."""
    from gemmactl.runtime.engine.placement import EnginePlacement
    from gemmactl.runtime.engine.spec import artifact_spec

    if not str(device).startswith("cuda"):
        return None
    return EnginePlacement(("resident",) * artifact_spec(artifact).n_layers, tables_on_host=True,
                           reason="the draft: every layer on the GPU, its tables in host memory")


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
