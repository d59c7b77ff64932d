"""One-shot generation: route a prompt to a tier, resolve its model, open its backend."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from gemmactl.errors import BackendUnavailableError, EmptyPromptError
from gemmactl.models import resolve_model_ref
from gemmactl.recipes import Recipe, Tier
from gemmactl.router import Route, route
from gemmactl.runtime import available_backends, backend_class
from gemmactl.runtime.base import Backend, GenerationRequest, check_request
from gemmactl.store import Store


@dataclass(frozen=True)
class RunSpec:
    """Everything decided before a model is touched: route, tier, model and request."""

    route: Route
    tier: Tier
    model_ref: str
    model_from_recipe: bool
    request: GenerationRequest


def plan_run(
    prompt: str,
    recipe: Recipe,
    *,
    tier: str | None = None,
    model: str | None = None,
    max_tokens: int | None = None,
    temperature: float | None = None,
    seed: int | None = None,
    raw: bool = False,
) -> RunSpec:
    """Validate the inputs and decide tier, model and sampling; loads nothing."""
    if not prompt.strip():
        raise EmptyPromptError("the prompt is empty")
    chosen = route(prompt, list(recipe.tiers), default_tier=recipe.default_tier, override=tier)
    if not chosen.prompt.strip():
        raise EmptyPromptError(f"the prompt is empty after the '{chosen.prefix}' prefix")
    spec_tier = recipe.tier(chosen.tier)
    sampling = spec_tier.sampling
    request = GenerationRequest(
        prompt=chosen.prompt,
        max_tokens=sampling.max_tokens if max_tokens is None else max_tokens,
        temperature=sampling.temperature if temperature is None else temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        min_p=sampling.min_p,
        repeat_penalty=sampling.repeat_penalty,
        seed=seed,
        thinking=spec_tier.thinking if chosen.thinking is None else chosen.thinking,
        raw=raw,
    )
    check_request(request)
    if spec_tier.backend not in available_backends():
        raise BackendUnavailableError(
            f"tier '{spec_tier.name}' runs on the {spec_tier.backend} backend, which needs "
            f"{spec_tier.needs or 'support this version of gemmactl does not have'}",
            hint=f"Use another tier (--tier {_other_tier(recipe, spec_tier.name)}) for now"
            + (f"; its model is made with: {' && '.join(spec_tier.make)}" if spec_tier.make else "")
            + ".",
        )
    return RunSpec(
        route=chosen,
        tier=spec_tier,
        model_ref=model or spec_tier.model,
        model_from_recipe=model is None,
        request=request,
    )


def resolve_run_model(spec: RunSpec, store: Store, progress: Callable[[int, int], None] | None = None) -> Path:
    """The GGUF file or int4-stream artifact the run will load (assembling the embedded model on first use)."""
    hint = None
    if spec.model_from_recipe and spec.tier.make:
        hint = f"Make it with: {' && '.join(spec.tier.make)}"
    return resolve_model_ref(spec.model_ref, store, missing_hint=hint, progress=progress)


def model_backend(model_path: Path, tier_backend: str) -> str:
    """The backend the model's format needs (int4-stream → int4, GGUF → llamacpp), else the tier's."""
    from gemmactl.formats import detect_format

    return {"int4-stream": "int4", "gguf": "llamacpp"}.get(detect_format(model_path), tier_backend)


def open_backend(spec: RunSpec, model_path: Path, store: Store | None = None) -> Backend:
    """Load the backend for the model (llama.cpp from the active build when there is one)."""
    backend = model_backend(model_path, spec.tier.backend)
    options = {}
    placement = None
    if backend == "llamacpp" and store is not None:
        from gemmactl.llamacpp.library import select_library
        from gemmactl.plan.auto import auto_placement

        options["library"] = select_library(store)
        # A model that does not fit the GPU whole gets the plan's layer split (docs/placement.md).
        placement = auto_placement(model_path, spec.tier.context, store=store)
        if placement.applied:
            options.update(
                n_gpu_layers=placement.n_gpu_layers,
                tensor_overrides=placement.tensor_overrides,
                extra_args={"swa_full": False},  # the plan sized sliding layers' KV to the window
            )
    loaded = backend_class(backend)(str(model_path), context_size=spec.tier.context, **options)
    if placement is not None:
        loaded.placement = placement
    return loaded


def _other_tier(recipe: Recipe, name: str) -> str:
    others = [t for t, tier in recipe.tiers.items() if t != name and tier.backend in available_backends()]
    return others[0] if others else recipe.default_tier
