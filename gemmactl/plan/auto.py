"""The placement `run` and `serve` apply by themselves when a model does not fit the GPU whole.

Fast: reads the GGUF header, asks nvidia-smi for free memory, and uses the cached machine
profile (or the default desktop profile's bandwidths, which only rank placements that fit).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import replace
from pathlib import Path

from gemmactl.errors import BudgetTooSmallError, GemmactlError
from gemmactl.machine import Machine, detect_machine
from gemmactl.runtime.base import GpuPlacement
from gemmactl.sizes import format_size


def _not_applied(reason: str, n_gpu_layers: int) -> GpuPlacement:
    return GpuPlacement(False, reason, n_gpu_layers)


def gpu_capable_library(store=None) -> bool:
    """Whether the llama.cpp that will run has a CUDA backend (looks for libggml-cuda next to libllama)."""
    folders = []
    if os.environ.get("LLAMA_CPP_LIB_PATH"):
        folders.append(Path(os.environ["LLAMA_CPP_LIB_PATH"]))
    try:
        from gemmactl.llamacpp.build import active_build
        from gemmactl.store import Store

        build = active_build(store or Store())
    except (GemmactlError, OSError):
        build = None
    if build is not None:
        folders.append(Path(build.lib_dir))
    spec = importlib.util.find_spec("llama_cpp")
    if spec and spec.origin:
        folders.append(Path(spec.origin).parent / "lib")
    return any(any(folder.glob("libggml-cuda*")) for folder in folders if folder.is_dir())


def auto_placement(
    model_path: Path,
    context: int,
    *,
    parallel: int = 1,
    machine: Machine | None = None,
    gpu_capable: bool | None = None,
    free_vram: int | None = None,
    store=None,
    kv_cache: str | None = None,
) -> GpuPlacement:
    """Decide -ngl / -ot for a GGUF at this context; reads headers only.

    machine, gpu_capable and free_vram default to what this machine has (tests pass fakes).
    kv_cache: llama.cpp's cache type (f16, q8_0, q4_0) the KV is sized for.
    """
    from gemmactl.plan.inventory import inventory_from_gguf, with_kv_type
    from gemmactl.plan.llama_args import tensor_overrides
    from gemmactl.plan.profile import DEFAULT_PROFILE, cached_profile, gpu_free_bytes, load_profile
    from gemmactl.plan.solver import Budget, Placement, evaluate, fits, plan_placement
    from gemmactl.store import Store

    machine = machine or detect_machine()
    if not machine.gpus:
        return _not_applied("plan: no NVIDIA GPU; every layer on the CPU", 0)
    store = store or Store()
    if gpu_capable is None:
        gpu_capable = gpu_capable_library(store)
    if not gpu_capable:
        return _not_applied("plan: the llama.cpp in use has no CUDA backend (run `gemmactl build`); every layer on the CPU", 0)
    gpu = machine.gpus[0]
    vram = free_vram if free_vram is not None else (gpu_free_bytes(gpu.index) or gpu.memory_bytes)
    profile = cached_profile(store.home / "plan", machine) or load_profile(DEFAULT_PROFILE)
    profile = replace(profile, vram_bytes=gpu.memory_bytes, ram_bytes=machine.ram_bytes or profile.ram_bytes)
    inventory = with_kv_type(inventory_from_gguf(Path(model_path)), kv_cache)
    budget = Budget(vram, profile.ram_bytes)
    n = inventory.shape.n_layers
    whole = evaluate(inventory, profile, budget, Placement(n + 1), context, parallel)
    if fits(whole):
        return _not_applied(f"plan: fits the GPU whole ({format_size(whole.gpu_bytes)} of {format_size(vram)} free)", -1)
    try:
        plan = plan_placement(inventory, profile, budget, context=context, parallel=parallel)
    except BudgetTooSmallError:
        return _not_applied(f"plan: not even one layer fits the {format_size(vram)} free on the GPU; every layer on the CPU", 0)
    gpu_layers = sum(1 for layer in plan.layers if layer.device == "gpu")
    output = " and the output layer" if plan.output_on_gpu else ""
    reason = f"plan: {gpu_layers}/{n} layers{output} on GPU ({format_size(plan.gpu_bytes)} of {format_size(vram)} free)"
    if plan.placement.cpu_expert_layers:
        reason += f", experts of {len(plan.placement.cpu_expert_layers)} GPU layers in RAM"
    overrides = tensor_overrides(plan)
    server_args = ["-ngl", str(plan.placement.n_gpu_layers)]
    for value in overrides:
        server_args += ["-ot", value]
    server_args += ["--fit", "off"]  # llama-server would otherwise re-fit what it was told
    return GpuPlacement(True, reason, plan.placement.n_gpu_layers, overrides, tuple(server_args))


AUTO_PARALLEL_MAX = 16  # slots `parallel: auto` gives at most: past 16, batching gains little here


def auto_parallel(
    model_path: Path,
    context: int,
    *,
    max_slots: int = AUTO_PARALLEL_MAX,
    machine: Machine | None = None,
    gpu_capable: bool | None = None,
    free_vram: int | None = None,
    store=None,
    kv_cache: str | None = None,
) -> tuple[int, str]:
    """How many llama-server slots of `context` tokens a GGUF tier gets when its recipe says `auto`
    (each slot's KV cache sized for the tier's cache type kv_cache: f16, q8_0 or q4_0).

    With a usable GPU: the most slots (up to max_slots) whose KV cache still lets the whole model
    stay on the GPU — more slots than that would push layers off it and slow every request; one
    slot when even one does not fit whole. Without one: the most slots whose KV cache fits in RAM
    beside the weights. Reads headers only; returns (slots, the reason in one line).
    """
    from gemmactl.plan.inventory import inventory_from_gguf, with_kv_type
    from gemmactl.plan.profile import DEFAULT_PROFILE, cached_profile, gpu_free_bytes, load_profile
    from gemmactl.plan.solver import Budget, Placement, evaluate, fits
    from gemmactl.store import Store

    machine = machine or detect_machine()
    store = store or Store()
    inventory = with_kv_type(inventory_from_gguf(Path(model_path)), kv_cache)
    n = inventory.shape.n_layers
    profile = cached_profile(store.home / "plan", machine) or load_profile(DEFAULT_PROFILE)
    ram = machine.ram_bytes or profile.ram_bytes
    profile = replace(profile, ram_bytes=ram)
    if gpu_capable is None:
        gpu_capable = bool(machine.gpus) and gpu_capable_library(store)
    if machine.gpus and gpu_capable:
        gpu = machine.gpus[0]
        vram = free_vram if free_vram is not None else (gpu_free_bytes(gpu.index) or gpu.memory_bytes)
        budget, placement, where = Budget(vram, ram), Placement(n + 1), f"the {format_size(vram)} free on the GPU"
    else:
        budget, placement, where = Budget(0, ram), Placement(0), f"{format_size(ram)} of RAM"
    best = 0
    for slots in range(1, max_slots + 1):
        if not fits(evaluate(inventory, profile, budget, placement, context, slots)):
            break
        best = slots
    if best == 0:
        return 1, f"parallel auto: 1 slot (the whole model with one {context}-token slot does not fit {where})"
    plural = "slot" if best == 1 else "slots"
    return best, f"parallel auto: {best} {plural} of {context} tokens fit {where} with the whole model"


def engine_placement(artifact: Path, context: int, *, vram: int | None = None, machine: Machine | None = None,
                     store=None, kv_mode: str | None = None, draft=None):
    """The engine's placement of an int4-stream artifact on this machine's GPU (None without one:
    the CPU runs it all). vram: the tier's budget (default: the GPU's free memory). draft: a
    plan/engine_map.DraftNeed whose GPU bytes the budget holds too. A budget too small for the
    engine raises BudgetTooSmallError with the minimum that works."""
    from gemmactl.plan.engine_map import check_host_memory, plan_engine_or_say_the_longest
    from gemmactl.plan.profile import DEFAULT_PROFILE, cached_profile, gpu_free_bytes, load_profile
    from gemmactl.store import Store

    machine = machine or detect_machine()
    if not machine.gpus:
        return None
    store = store or Store()
    gpu = machine.gpus[0]
    free = gpu_free_bytes(gpu.index) or gpu.memory_bytes
    budget = min(vram, free) if vram else free
    profile = cached_profile(store.home / "plan", machine) or load_profile(DEFAULT_PROFILE)
    profile = replace(profile, vram_bytes=gpu.memory_bytes, ram_bytes=machine.ram_bytes or profile.ram_bytes)
    chosen = plan_engine_or_say_the_longest(Path(artifact), profile, budget, context, kv_mode, draft)
    if draft is not None:
        chosen = with_draft_cost(chosen, plan_engine_or_say_the_longest(Path(artifact), profile, budget, context,
                                                                         kv_mode))
    check_host_memory(chosen, machine.ram_bytes)  # before anything is loaded
    return placement_of(chosen, profile)


DRAFT_COST_SHOWN = 1.05  # the model alone predicted this much faster: the map's reason says so


def with_draft_cost(beside, alone):
    """The map made beside a draft, its reason saying what the draft's room costs the model where
    the map without the draft is predicted faster. Speculation is judged against plain decoding
    with the same map (its tuner cannot see the other); a draft under a tight budget can cost more
    than it gives: under 4 GiB on an H100 an E4B target beside an E2B draft decoded 22.8 tok/s
    plainly and 34.4 speculating, where alone it decoded 91.2 (docs/benchmarks.md)."""
    if beside.decode_tok_s <= 0 or alone.decode_tok_s <= beside.decode_tok_s * DRAFT_COST_SHOWN:
        return beside
    need = alone.decode_tok_s / beside.decode_tok_s
    return replace(beside, reason=f"{beside.reason}; the draft's room costs the model: {beside.decode_tok_s:.1f} "
                                  f"tok/s predicted beside it against {alone.decode_tok_s:.1f} alone "
                                  f"(speculation must give {need:.1f}× to pay)")


def placement_of(chosen, profile):
    """An engine map (plan/engine_map.EngineMap) as the placement the engine loads."""
    from gemmactl.runtime.engine.placement import EnginePlacement

    room = chosen.expert_room_bytes if chosen.expert_room_bytes is not None else chosen.expert_cache_bytes
    return EnginePlacement(chosen.layers, chosen.tables_on_host, chosen.reason, room,
                           link_bytes_s=profile.host_to_device, host_bytes_s=profile.cpu_bandwidth,
                           expert_cpu_share=chosen.expert_cpu_share if chosen.experts else None)


def rpc_placement(model_path: Path, context: int, endpoints, *, parallel: int = 1, vram: int | None = None,
                  machine: Machine | None = None, store=None) -> GpuPlacement:
    """The split of a GGUF across this machine and its RPC workers (plan/rpc_split.py), after
    asking every worker for its protocol and memory: an unreachable worker or one of another
    llama.cpp build stops here with one line naming it."""
    from gemmactl.llamacpp.build import active_build
    from gemmactl.llamacpp.rpc import check_workers
    from gemmactl.plan.inventory import inventory_from_gguf
    from gemmactl.plan.profile import DEFAULT_PROFILE, cached_profile, gpu_free_bytes, load_profile
    from gemmactl.plan.rpc_split import split_layers
    from gemmactl.store import Store

    machine = machine or detect_machine()
    store = store or Store()
    workers = check_workers(endpoints, active_build(store))
    profile = cached_profile(store.home / "plan", machine) or load_profile(DEFAULT_PROFILE)
    head_gpu = bool(machine.gpus) and gpu_capable_library(store)
    if head_gpu:
        gpu = machine.gpus[0]
        free = gpu_free_bytes(gpu.index) or gpu.memory_bytes
        head = min(vram, free) if vram else free
    else:
        head = machine.ram_bytes or profile.ram_bytes
    split = split_layers(inventory_from_gguf(Path(model_path)), workers, head_bytes=head, head_gpu=head_gpu,
                         profile=profile, context=context, parallel=parallel)
    return GpuPlacement(True, split.reason, split.n_gpu_layers, (), tuple(split.server_args),
                        rpc=tuple(w.endpoint.address for w in workers))
