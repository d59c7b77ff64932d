"""The one road from a prompt to a model: route → request → resolve → open (placement applied) → stream.

`run`, `serve` (in-process tiers whole, llama-server tiers for their placement), `bench`,
`doctor` and `plan --verify` all come through here, so a model is resolved, placed and opened
the same way whoever asks. The stream itself is `runtime.base.stream_generate`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gemmactl.errors import BackendUnavailableError, EmptyPromptError, GemmactlError, InvalidOptionError
from gemmactl.recipes import Recipe, Speculative, Tier
from gemmactl.router import Route, route
from gemmactl.runtime import available_backends, backend_class
from gemmactl.runtime.base import Backend, GenerationRequest, GpuPlacement, stream_generate
from gemmactl.store import Store
from gemmactl.store.refs import GGUF, INT4_STREAM, RUNNABLE, ResolvedModel, resolve_model

__all__ = ["RunSpec", "route_prompt", "make_request", "plan_run", "resolve_run_model", "open_backend",
           "open_model", "gpu_placement", "speculative_args", "stream_generate"]

# The backend each runnable format needs.
BACKEND_OF_FORMAT = {GGUF: "llamacpp", INT4_STREAM: "int4"}
AUTO = "auto"


@dataclass(frozen=True)
class RunSpec:
    """Everything decided before a model is touched: route, tier, model and request."""

    route: Route
    tier: Tier
    model_ref: str
    model_from_recipe: bool
    request: GenerationRequest


# -- route and request ---------------------------------------------------------------------------


def route_prompt(text: str, recipe: Recipe, *, tier: str | None = None) -> Route:
    """Pick the tier for a prompt, and make sure something is left to answer once its prefix is gone."""
    if not text.strip():
        raise EmptyPromptError("the prompt is empty")
    chosen = route(text, list(recipe.tiers), default_tier=recipe.default_tier, override=tier)
    if not chosen.prompt.strip():
        raise EmptyPromptError(f"the prompt is empty after the '{chosen.prefix}' prefix")
    return chosen


def make_request(chosen: Route, tier: Tier, *, thinking: bool | None = None, **settings) -> GenerationRequest:
    """The request for a routed prompt: the tier's sampling, changed by the caller's settings (None keeps
    the tier's); thinking from the caller, else the prefix, else the tier."""
    if thinking is None:
        thinking = tier.thinking if chosen.thinking is None else chosen.thinking
    return GenerationRequest.from_sampling(chosen.prompt, tier.sampling, thinking=thinking, **settings)


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
    system: str | None = None,
) -> RunSpec:
    """Route a one-shot prompt and decide tier, model and sampling; loads nothing."""
    chosen = route_prompt(prompt, recipe, tier=tier)
    spec_tier = recipe.tier(chosen.tier)
    request = make_request(chosen, spec_tier, max_tokens=max_tokens, temperature=temperature, seed=seed, raw=raw,
                           system=system or None)
    check_backend(recipe, spec_tier)
    return RunSpec(route=chosen, tier=spec_tier, model_ref=model or spec_tier.model,
                   model_from_recipe=model is None, request=request)


def check_backend(recipe: Recipe, tier: Tier) -> None:
    """Refuse a tier whose backend this installation cannot run, naming a tier that can."""
    if tier.backend in available_backends():
        return
    others = [name for name, other in recipe.tiers.items() if name != tier.name and other.backend in available_backends()]
    raise BackendUnavailableError(
        f"tier '{tier.name}' runs on the {tier.backend} backend, which needs "
        f"{tier.needs or 'support this version of gemmactl does not have'}",
        hint=f"Use another tier (--tier {others[0] if others else recipe.default_tier}) for now"
        + (f"; its model is made with: {' && '.join(tier.make)}" if tier.make else "") + ".",
    )


# -- resolve -------------------------------------------------------------------------------------


def resolve_run_model(spec: RunSpec, store: Store, progress: Callable[[int, int], None] | None = None) -> ResolvedModel:
    """The GGUF file or int4-stream artifact the run will load (assembling the embedded model on first use)."""
    hint = f"Make it with: {' && '.join(spec.tier.make)}" if spec.model_from_recipe and spec.tier.make else None
    return resolve_model(spec.model_ref, store, accept=RUNNABLE, missing_hint=hint, progress=progress)


def backend_for(model: ResolvedModel) -> str:
    """The backend a model's format needs (GGUF → llamacpp, int4-stream → int4)."""
    return BACKEND_OF_FORMAT[model.format]


# -- open ----------------------------------------------------------------------------------------


def open_backend(
    model: ResolvedModel,
    *,
    context: int,
    store: Store,
    placement: GpuPlacement | str | None = AUTO,
    parallel: int = 1,
    library=None,
    threads: int | None = None,
    extra_args: dict | None = None,
    vram: int | None = None,
    rpc: tuple[str, ...] = (),
    experts=None,
    kv_cache: str | None = None,
    yarn: float | None = None,
    draft=None,
) -> Backend:
    """Load the model on the backend its format needs.

    llama.cpp models run on the active build's library when it matches, placed by the planner
    (`placement="auto"`: all layers on the GPU when they fit, the plan's split when they do not,
    docs/placement.md) or as the caller says (a GpuPlacement; None: llama.cpp's own default).
    int4-stream artifacts run in the engine, placed by the engine's map on a GPU ("auto") or as
    the caller says (an EnginePlacement). vram: the tier's GPU budget (default: free memory).
    rpc: RPC workers (HOST:PORT[=SIZE]) that take a share of a GGUF's layers (plan/rpc_split.py).
    experts: an ExpertSettings for MoE models on the engine (expert_settings_for builds it).
    kv_cache: the KV cache mode (runtime/engine/kv_modes.py: the engine's modes, or llama.cpp's
    cache types). yarn: a YaRN factor for the engine's global layers. draft: a DraftSettings
    (draft_settings_for) for the engine's speculative decoding.
    """
    from gemmactl.runtime.engine.kv_modes import check_mode

    kind = backend_for(model)
    options: dict = {"context_size": context, "n_threads": threads}
    if experts is not None and not experts.is_default and kind != "int4":
        raise InvalidOptionError("the expert cache belongs to the int4 engine, and this model runs on llama.cpp",
                                 hint="Drop the --expert-* options (GGUF tiers keep experts on the CPU with "
                                      "the plan's -ot), or give the tier an int4-stream artifact.")
    check_mode(kv_cache, kind)
    if draft is not None and kind != "int4":
        raise InvalidOptionError("--draft speculates on the int4 engine, and this model runs on llama.cpp",
                                 hint="Drop --draft; a GGUF tier speculates in `gemmactl serve` with the recipe's "
                                      "speculative: draft_model.")
    if yarn and kind != "int4":
        raise InvalidOptionError("a YaRN factor is applied by the int4 engine, and this model runs on llama.cpp",
                                 hint="Drop --yarn (or the tier's yarn:), or give the tier an int4-stream artifact.")
    if kind == "llamacpp":
        from gemmactl.llamacpp.library import select_library

        if placement == AUTO:
            placement = gpu_placement(model.path, context, parallel=parallel, store=store, vram=vram, rpc=rpc,
                                      kv_cache=kv_cache)
        if placement is not None and placement.rpc:
            return _served(model, placement, context=context, threads=threads, store=store, kv_cache=kv_cache)
        extra = dict(extra_args or {})
        if kv_cache:
            extra.update(llama_kv_args(kv_cache))
        if placement is not None and placement.applied:
            options.update(n_gpu_layers=placement.n_gpu_layers, tensor_overrides=placement.tensor_overrides)
            extra.setdefault("swa_full", False)  # the plan sized the sliding layers' KV to the window
        options.update(library=library or select_library(store), placement=placement, extra_args=extra)
    elif kind == "int4":
        if rpc:
            raise InvalidOptionError("RPC workers take llama.cpp (GGUF) tiers; this model runs on the int4 engine",
                                     hint="Drop --rpc (or the tier's rpc:), or give the tier a GGUF model.")
        if placement == AUTO:
            placement, draft = _engine_placement_with_draft(model, context, vram, store, kv_cache, draft)
        options["placement"] = placement
        if experts is not None:
            options["experts"] = experts
        options.update(kv_mode=kv_cache, yarn=yarn)
        if draft is not None:
            options["draft"] = draft
    return backend_class(kind)(str(model.path), **options)


def _engine_placement_with_draft(model: ResolvedModel, context: int, vram, store, kv_cache, draft):
    """The engine's map on this GPU with room kept for the draft (its weights and KV caches, and
    the spare ring slots both models need). When the model does not fit beside the draft, the map
    is made without it and the draft is dropped: the tier runs, without speculation, and says why."""
    from dataclasses import replace

    from gemmactl.errors import BudgetTooSmallError
    from gemmactl.plan.auto import engine_placement
    from gemmactl.plan.engine_map import DraftNeed

    need = DraftNeed(Path(draft.path), draft.k_max) if draft is not None and not draft.problem else None
    try:
        return engine_placement(model.path, context, vram=vram, store=store, kv_mode=kv_cache, draft=need), draft
    except BudgetTooSmallError as exc:
        if need is None:
            raise
        problem = f"it does not fit beside the model in the GPU budget: {exc.message}"
    except (GemmactlError, OSError, ValueError, KeyError) as exc:  # the draft's index unreadable: its load says more
        if need is None:
            raise
        problem = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    placement = engine_placement(model.path, context, vram=vram, store=store, kv_mode=kv_cache)
    return placement, replace(draft, problem=problem)


LLAMA_KV_TYPES = {"f16": 1, "q8_0": 8, "q4_0": 2}  # ggml type ids (llama_cpp.GGML_TYPE_*)


def llama_kv_args(mode: str) -> dict:
    """llama-cpp-python's arguments for a KV cache type: the same type for K and V, and flash
    attention, which llama.cpp needs to keep V quantized."""
    kind = LLAMA_KV_TYPES[mode]
    return {"type_k": kind, "type_v": kind, "flash_attn": mode != "f16"}


def draft_settings_for(tier, store: Store, draft: str | None = None, draft_max: int | None = None,
                       tune: bool | None = None, engine: bool | None = None):
    """The engine's draft a run asks for: --draft REF (an int4-stream artifact of the same
    vocabulary), --draft-max N and --no-draft-tune over the tier's `speculative:` (kind draft,
    enabled, on an int4 tier; engine: whether the tier's model runs on the engine, default its
    `backend:`). None: no speculation."""
    from gemmactl.runtime.engine.draft import DEFAULT_DRAFT_MAX, DraftSettings

    spec = tier.speculative if tier.speculative is not None and tier.speculative.enabled else None
    on_engine = tier.backend == "int4" if engine is None else engine
    ref = draft or (spec.draft_model if spec is not None and spec.kind == "draft" and on_engine else None)
    if ref is None:
        if draft_max is not None or tune is not None:
            raise InvalidOptionError("--draft-max and --no-draft-tune need a draft model",
                                     hint="Add --draft MODEL (an int4-stream artifact of the same vocabulary).")
        return None
    k_max = draft_max or (spec.draft_max if spec is not None and draft is None else DEFAULT_DRAFT_MAX)
    tune = True if tune is None else tune
    try:
        resolved = resolve_model(ref, store, accept=(INT4_STREAM,),
                                 missing_hint="A draft is an int4-stream artifact: `gemmactl quantize MODEL --int4-stream`.")
    except GemmactlError as exc:
        if draft is not None and not Path(ref).exists():
            raise  # a draft named on the command line that is not there: the user's to fix
        # There but unreadable (or the recipe's): the tier runs without speculation, and says so.
        return DraftSettings(ref, k_max=k_max, tune=tune, problem=exc.message)
    return DraftSettings(str(resolved.path), k_max=k_max, tune=tune)


def expert_settings_for(tier, cache: str | None = None, policy: str | None = None, prefetch: bool | None = None,
                        cpu_share: str | None = None):
    """The expert cache a run asks for: the options (--expert-cache SIZE|auto|off, --expert-policy,
    --expert-prefetch, --expert-cpu-share) over the tier's expert_cache / expert_policy /
    expert_prefetch / expert_cpu_share."""
    from gemmactl.runtime.engine.expert_settings import (ExpertSettings, check_policy, parse_cpu_share,
                                                         parse_expert_cache)

    cache_bytes = parse_expert_cache(cache) if cache is not None else tier.expert_cache
    chosen = check_policy(policy if policy is not None else tier.expert_policy)
    share = parse_cpu_share(cpu_share) if cpu_share is not None else tier.expert_cpu_share
    return ExpertSettings(cache_bytes=cache_bytes, policy=chosen,
                          prefetch=tier.expert_prefetch if prefetch is None else prefetch, cpu_share=share)


def _served(model: ResolvedModel, placement: GpuPlacement, *, context: int, threads: int | None, store: Store,
            kv_cache: str | None = None) -> Backend:
    """A GGUF split across RPC workers runs in a llama-server child: llama.cpp aborts the process
    whose worker connection breaks, and that must not be this one. kv_cache: llama.cpp's cache
    type for K and V (the split was planned with it), with flash attention on for a quantized V."""
    from gemmactl.llamacpp.build import active_build
    from gemmactl.llamacpp.served import ServedBackend
    from gemmactl.runtime.llamacpp import default_threads

    build = active_build(store)
    if build is None or "llama-server" not in build.binaries:
        raise BackendUnavailableError("RPC workers need llama-server from `gemmactl build`, and there is no build",
                                      hint="Run `gemmactl build` (it builds the RPC backend too).")
    return ServedBackend(build.binary("llama-server"), str(model.path), context_size=context,
                         n_threads=threads or default_threads(), log_dir=store.home / "logs" / "run",
                         placement=placement, library=f"build {build.build_id} (llama-server)", kv_cache=kv_cache)


def open_model(ref: str, store: Store, *, accept: tuple[str, ...] = RUNNABLE, context: int,
               placement: GpuPlacement | str | None = AUTO, **options) -> Backend:
    """Resolve a model reference and open it (doctor's proof, plan --verify, scripts)."""
    return open_backend(resolve_model(ref, store, accept=accept), context=context, store=store, placement=placement,
                        **options)


def gpu_placement(model_path: Path, context: int, *, parallel: int = 1, store: Store | None = None,
                  vram: int | None = None, rpc: tuple[str, ...] = (), kv_cache: str | None = None) -> GpuPlacement:
    """Where llama.cpp should put a GGUF's layers on this machine, from the planner (headers only),
    with its KV cache sized for the cache type kv_cache (f16 by default).

    A planner that cannot read the model leaves every layer offered to the GPU, and says why.
    With RPC workers, the split across them (a worker that cannot be used stops here).
    """
    if rpc:
        from gemmactl.endpoints import parse_endpoints
        from gemmactl.plan.auto import rpc_placement

        return rpc_placement(Path(model_path), context, parse_endpoints(rpc), parallel=parallel, vram=vram, store=store)
    try:
        from gemmactl.plan.auto import auto_placement

        free = None
        if vram:
            from gemmactl.machine import detect_machine
            from gemmactl.plan.profile import gpu_free_bytes

            gpus = detect_machine().gpus
            free = min(vram, (gpu_free_bytes(gpus[0].index) or gpus[0].memory_bytes) if gpus else vram)
        return auto_placement(Path(model_path), context, parallel=parallel, store=store, free_vram=free,
                              kv_cache=kv_cache)
    except (GemmactlError, OSError, ValueError) as exc:
        return GpuPlacement.all_on_gpu(f"planner failed ({exc}): every layer offered to the GPU")


def speculative_args(spec: Speculative | None, store: Store) -> tuple[tuple[str, ...], str]:
    """llama-server flags for a tier's speculative decoding, and how /metrics and bench describe it."""
    if spec is None or not spec.enabled:
        return (), "off"
    args = ["--spec-type", spec.spec_type]
    note = spec.kind
    if spec.draft_model:
        draft = resolve_model(spec.draft_model, store, accept=(GGUF,)).path
        args += ["-md", str(draft)]
        note = f"{spec.kind} ({draft.name})"
    if spec.kind != "ngram":
        args += ["--spec-draft-n-max", str(spec.draft_max), "--spec-draft-n-min", str(spec.draft_min)]
    return tuple(args), note
