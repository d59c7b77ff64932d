"""From a model reference and budgets to a plan, and the plan as the JSON docs/placement.md describes."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from gemmactl.errors import BudgetTooSmallError, InvalidOptionError
from gemmactl.plan.inventory import GLOBAL_KINDS, take_inventory, with_kv_type
from gemmactl.plan.llama_args import llama_cpp_args, torch_device_map
from gemmactl.plan.profile import DEFAULT_PROFILE, HardwareProfile, gpu_free_bytes, load_profile, machine_profile
from gemmactl.sizes import format_size, parse_size
from gemmactl.plan.solver import PROMPT_TOKENS, Budget, Plan, plan_placement

PLAN_FORMAT = "gemmactl-plan"
PLAN_VERSION = 1


@dataclass
class PlanResult:
    plan: Plan
    model_path: Path
    hardware_measured: bool = False  # the profile was measured by this run
    warnings: list[str] = field(default_factory=list)
    engine: object | None = None  # plan/engine_map.EngineMap: the int4 engine's map of an int4-stream artifact
    rpc: object | None = None  # plan/rpc_split.RpcSplit: the split across this machine and RPC workers
    draft: object | None = None  # plan/engine_map.DraftNeed: the draft the engine's map keeps room for


def resolve_plan_model(ref: str, store) -> Path:
    """A store name (any format), "embedded", or a path to a GGUF file, a model folder or a config.json."""
    from gemmactl.store.refs import ANY, resolve_model

    path = Path(ref).expanduser()
    if path.is_file() and path.suffix == ".json" and store.get(ref) is None:
        return path  # a config.json alone
    return resolve_model(ref, store, accept=ANY).path


def choose_profile(hardware: str | None, remeasure: bool, store) -> tuple[HardwareProfile, bool, list[str], int | None]:
    """(profile, measured now, notes, free VRAM of this machine's GPU or None)."""
    from gemmactl.machine import detect_machine

    if hardware and not remeasure:
        return load_profile(hardware), False, [f"planned for the shipped '{hardware}' profile"], None
    machine = detect_machine()
    if not machine.gpus and not remeasure:
        profile = load_profile(DEFAULT_PROFILE)
        return profile, False, [f"this machine has no NVIDIA GPU: planned for the '{DEFAULT_PROFILE}' profile ({profile.description})"], None
    measured_profile, measured = machine_profile(store.home / "plan", machine, remeasure=remeasure)
    if hardware:
        return load_profile(hardware), measured, [f"planned for the shipped '{hardware}' profile"], None
    if not machine.gpus:
        profile = load_profile(DEFAULT_PROFILE)
        return profile, measured, [f"this machine has no NVIDIA GPU: planned for the '{DEFAULT_PROFILE}' profile ({profile.description})"], None
    gpu = machine.gpus[0]
    return measured_profile, measured, [f"planned for this machine ({gpu.name})"], gpu_free_bytes(gpu.index) or gpu.memory_bytes


def build_plan(
    model: str,
    *,
    vram: str | None = None,
    ram: str | None = None,
    context: int | str = 8192,
    parallel: int = 1,
    backend: str = "llamacpp",
    quant: str | None = None,
    hardware: str | None = None,
    remeasure: bool = False,
    store=None,
    rpc: tuple[str, ...] = (),
    kv_cache: str | None = None,
    draft: str | None = None,
    draft_max: int | None = None,
) -> PlanResult:
    """Inventory the model, pick the profile and budgets, and solve. context "max": the longest
    the int4 engine's plan fits in the budget. kv_cache: the KV cache mode to size (the engine's,
    or llama.cpp's f16/q8_0/q4_0). draft: a draft model reference whose GPU memory the engine's
    map keeps (its weights and KV caches, and draft_max spare ring slots in both models)."""
    from gemmactl.runtime.engine.kv_modes import check_mode
    from gemmactl.store import Store

    store = store or Store()
    vram_bytes = parse_size(vram, option="--vram") if vram is not None else None
    ram_bytes = parse_size(ram, option="--ram") if ram is not None else None
    longest = context == "max"
    if longest and backend != "int4":
        raise InvalidOptionError("--context max asks the int4 engine's plan for its longest context; llama.cpp plans "
                                 "take a given context",
                                 hint="Plan an int4-stream artifact with --backend int4, or give --context N.")
    check_mode(kv_cache, backend)
    need = _draft_need(draft, draft_max, backend, store)
    if longest:
        context = 256  # for the checks below; the engine's plan finds the longest
    if context < 1:
        raise InvalidOptionError(f"--context must be at least 1, got {context}")
    path = resolve_plan_model(model, store)
    inventory = take_inventory(path, quant=quant)
    if backend != "int4":
        inventory = with_kv_type(inventory, kv_cache)
    if backend == "int4" and inventory.source == "gguf":
        raise InvalidOptionError(
            "the int4 backend runs int4-stream artifacts, not GGUF files",
            hint="Plan an int4-stream artifact, or a checkpoint with --quant int4-g32; or use --backend llamacpp.",
        )
    limit = inventory.shape.max_context
    if limit and context > limit:
        raise InvalidOptionError(
            f"--context {context} is above this model's maximum of {limit} tokens",
            hint=f"Pass --context {limit} or less.",
        )
    profile, measured, notes, free = choose_profile(hardware, remeasure, store)
    warnings = []
    detected = profile.vram_bytes
    if vram_bytes is not None and detected and vram_bytes > detected:
        # The detected GPU's, or (none detected) the profile's card planned for.
        warnings.append(f"--vram {format_size(vram_bytes)} is more than the {format_size(detected)} the GPU has ({profile.gpu_name})")
    if vram_bytes is None:
        vram_bytes = free if free is not None else profile.vram_bytes
    if ram_bytes is None:
        ram_bytes = profile.ram_bytes
    if not profile.has_gpu or profile.gpu_bandwidth <= 0:
        profile = replace(profile, vram_bytes=0)
    budget = Budget(vram_bytes if profile.has_gpu else 0, ram_bytes)
    engine_planned = backend == "int4" and inventory.source == "int4-stream" and profile.has_gpu
    try:
        plan = plan_placement(inventory, profile, budget, context=context, parallel=parallel)
    except BudgetTooSmallError:
        if engine_planned and not longest:
            # The engine's least budget is its own (its CUDA context, staging areas, the host
            # memory it keeps): say that one, not llama.cpp's, which would send the user to a
            # budget the engine refuses.
            from gemmactl.plan.engine_map import check_host_memory, plan_engine_or_say_the_longest

            check_host_memory(plan_engine_or_say_the_longest(path, profile, vram_bytes, context, kv_cache, need),
                              ram_bytes, given=ram is not None)
        raise
    plan.budget = Budget(vram_bytes, ram_bytes)
    engine = None
    if backend == "int4" and inventory.source == "int4-stream":
        from gemmactl.plan.engine_map import plan_engine_or_say_the_longest

        if longest:
            from gemmactl.plan.engine_map import longest_context

            if not profile.has_gpu:
                raise InvalidOptionError("--context max needs a GPU to plan for, and there is none here",
                                         hint="Pass --hardware desktop-4g (or another profile) with --vram.")
            context = longest_context(path, profile, vram_bytes, kv_cache, draft=need)
            plan = plan_placement(inventory, profile, budget, context=context, parallel=parallel)
            plan.budget = Budget(vram_bytes, ram_bytes)
        engine = (plan_engine_or_say_the_longest(path, profile, vram_bytes, context, kv_cache, need)
                  if profile.has_gpu else None)
        if engine is not None and longest:
            from gemmactl.plan.engine_map import longest_resident_context

            engine.longest_resident = longest_resident_context(path, profile, vram_bytes, kv_cache, draft=need)
        if engine is not None and need is not None:
            from gemmactl.plan.auto import with_draft_cost

            engine = with_draft_cost(engine, plan_engine_or_say_the_longest(path, profile, vram_bytes, context,
                                                                            kv_cache))
        if engine is not None:
            from gemmactl.plan.engine_map import check_host_memory

            check_host_memory(engine, ram_bytes, given=ram is not None)
    split = None
    if rpc:
        if backend == "int4":
            raise InvalidOptionError("--rpc splits a llama.cpp model; the int4 engine runs on one machine",
                                     hint="Plan with --backend llamacpp, or leave out --rpc.")
        split = _rpc_split(inventory, rpc, profile, vram_bytes, ram_bytes, context, parallel)
    plan.notes = notes + _plan_notes(plan, backend, quant, engine)
    return PlanResult(plan, path, measured, warnings, engine, split, need)


def _draft_need(draft: str | None, draft_max: int | None, backend: str, store):
    """The draft the engine's map keeps room for (plan/engine_map.DraftNeed), or None."""
    if draft is None:
        if draft_max is not None:
            raise InvalidOptionError("--draft-max sizes a draft's spare slots, and no --draft was given",
                                     hint="Add --draft MODEL, or leave out --draft-max.")
        return None
    if backend != "int4":
        raise InvalidOptionError("--draft plans the int4 engine's speculation; llama.cpp plans do not size a draft",
                                 hint="Plan an int4-stream artifact with --backend int4, or leave out --draft.")
    from gemmactl.plan.engine_map import DraftNeed
    from gemmactl.runtime.engine.draft import DEFAULT_DRAFT_MAX
    from gemmactl.store.refs import INT4_STREAM, resolve_model

    resolved = resolve_model(draft, store, accept=(INT4_STREAM,))
    return DraftNeed(Path(resolved.path), draft_max or DEFAULT_DRAFT_MAX)


def _rpc_split(inventory, rpc, profile, vram_bytes: int, ram_bytes: int, context: int, parallel: int):
    """The split across this machine and the workers; a worker without =SIZE is asked what it has free."""
    from gemmactl.endpoints import parse_endpoints
    from gemmactl.llamacpp.rpc import probe
    from gemmactl.plan.rpc_split import split_layers

    class _Planned:  # a worker as the split sees it: its address and what it lends
        def __init__(self, endpoint, lends):
            self.endpoint, self.lends = endpoint, lends

    workers = [_Planned(e, e.budget if e.budget is not None else probe(e).free_bytes) for e in parse_endpoints(rpc)]
    head_gpu = profile.has_gpu and profile.gpu_bandwidth > 0
    return split_layers(inventory, workers, head_bytes=vram_bytes if head_gpu else ram_bytes, head_gpu=head_gpu,
                        profile=profile, context=context, parallel=parallel)


def _plan_notes(plan: Plan, backend: str, quant: str | None, engine) -> list[str]:
    if backend == "int4":
        return _engine_notes(plan, engine)
    notes = []
    if plan.inventory.source == "config" and quant is None:
        notes.append(f"no --quant given: planned for {plan.inventory.quantization}, the GGUF type the fast tier runs; "
                     "pass --quant to plan another")
    if plan.fits_whole:
        notes.append("the whole model fits the GPU: run and serve use -ngl all and need no plan arguments")
    if plan.placement.cpu_expert_layers:
        notes.append(f"experts of {len(plan.placement.cpu_expert_layers)} GPU layers stay in RAM (only the active experts are read per token)")
    if plan.inventory.source == "config":
        notes.append(f"sizes are estimated from config.json at {plan.inventory.quantization}; no weights were read")
    return notes


def _engine_notes(plan: Plan, engine) -> list[str]:
    """The int4 backend is the engine: its own map (plan/engine_map.py) replaces llama.cpp's placement."""
    if plan.inventory.source != "int4-stream":
        return ["the int4 engine runs int4-stream artifacts: make one with `gemmactl quantize MODEL --int4-stream`, "
                "then plan it with --backend int4 for the engine's map; the layers above are llama.cpp's view"]
    if engine is None:
        return ["no GPU in this profile: the engine runs every layer on the CPU"]
    notes = ["llama_cpp_args and device_map are llama.cpp's and transformers' views; the engine follows the "
             "'engine' map"]
    if plan.parallel > 1:
        notes.append("the engine decodes one sequence at a time; --parallel applies to llama.cpp tiers")
    return notes


def plan_dict(plan: Plan, result: PlanResult | None = None, verified=None) -> dict:
    """The plan as JSON (docs/placement.md)."""
    inv, shape, profile = plan.inventory, plan.inventory.shape, plan.profile
    output_device = "gpu" if plan.output_on_gpu else "cpu"
    globals_ = []
    for kind in GLOBAL_KINDS:
        nbytes = inv.globals[kind]
        if kind == "output" and not nbytes and inv.output_tied:
            nbytes = inv.globals["token_embd"]  # tied: the embedding serves as the output matrix
        device = output_device if kind in ("output", "output_norm") else "cpu"
        globals_.append({"name": kind, "device": device, "bytes": nbytes, "tied": kind == "output" and inv.output_tied})
    data = {
        "format": PLAN_FORMAT,
        "version": PLAN_VERSION,
        "model": {
            "path": inv.path,
            "source": inv.source,
            "architecture": shape.architecture,
            "quantization": inv.quantization,
            "layers": shape.n_layers,
            "experts": shape.n_experts,
            "experts_used": shape.experts_used,
            "max_context": shape.max_context,
            "total_bytes": inv.total_bytes,
        },
        "hardware": {**profile.to_dict(), "measured_now": bool(result and result.hardware_measured)},
        "budget": {"vram_bytes": plan.budget.vram_bytes, "ram_bytes": plan.budget.ram_bytes},
        "context": plan.context,
        "parallel": plan.parallel,
        "totals": {"gpu_bytes": plan.gpu_bytes, "cpu_bytes": plan.cpu_bytes, "gpu": dict(plan.gpu), "cpu": dict(plan.cpu)},
        "layers": [
            {
                "index": layer.index,
                "device": layer.device,
                "experts_device": layer.experts_device,
                "sliding": layer.sliding,
                "kv_cells": layer.kv_cells,
                "bytes": dict(layer.bytes),
            }
            for layer in plan.layers
        ],
        "globals": globals_,
        "predicted": {
            "decode_tok_s": round(plan.decode_tok_s, 2),
            "ttft_s": round(plan.ttft_s, 4),
            "prompt_tokens": PROMPT_TOKENS,
            "read_per_token_bytes": dict(plan.read_per_token),
        },
        "llama_cpp_args": llama_cpp_args(plan),
        "device_map": torch_device_map(plan),
        "notes": list(plan.notes),
    }
    if result is not None and result.engine is not None:
        data["engine"] = result.engine.to_dict()
    if result is not None and result.rpc is not None:
        data["rpc"] = result.rpc.to_dict()
    if verified is not None:
        data["verify"] = verified.to_dict()
    return data
