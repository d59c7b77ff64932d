"""`plan --verify`: a short real decode with the plan's placement, measured against the prediction.

Peak GPU memory is this process's use as nvidia-smi reports it, sampled while the model loads
and decodes (CUDA context included, as the plan's reserve is). Without a usable GPU the run
uses the CPU placement and the prediction is re-made for it with this machine's measured profile.
The same holds for the int4 engine (`--backend int4`): its map on a GPU, every layer on the CPU
without one.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Callable

from gemmactl.machine import process_gpu_bytes, process_gpu_peak
from gemmactl.plan.solver import Budget, Placement, Plan, evaluate

if TYPE_CHECKING:
    from gemmactl.runtime.base import Backend

VERIFY_PROMPT = "Question: What is the capital of France?\nAnswer:"
VERIFY_TOKENS = 64


@dataclass(frozen=True)
class VerifyResult:
    n_gpu_layers: int
    tensor_overrides_applied: bool
    predicted_decode_tok_s: float
    measured_decode_tok_s: float
    decode_tokens: int
    peak_gpu_bytes: int
    budget_vram_bytes: int
    within_budget: bool
    placement: str  # "plan" or "cpu (no usable GPU here)"
    engine_layers: dict | None = None  # the int4 engine's run: layers resident, streamed and on the CPU

    @property
    def ratio(self) -> float:
        return self.measured_decode_tok_s / self.predicted_decode_tok_s if self.predicted_decode_tok_s else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "ratio": round(self.ratio, 3)}


class GpuMemorySampler:
    """This process's peak GPU memory as nvidia-smi reports it, sampled every 50 ms by one
    nvidia-smi that loops on its own (machine.SmiPeak); 0 without a GPU."""

    def __init__(self):
        self.peak = 0
        self._watch = process_gpu_peak()

    def __enter__(self):
        self._watch.__enter__()
        return self

    def __exit__(self, *exc):
        self._watch.__exit__(*exc)
        self.peak = max(self._watch.peak, process_gpu_bytes())


def verify_plan(plan: Plan, open_backend: Callable[..., Backend], *, store=None,
                announce: Callable[[str], None] | None = None) -> VerifyResult:
    """Load the GGUF with the plan's -ngl, decode VERIFY_TOKENS tokens greedily, compare.

    open_backend(context=, placement=, extra_args=) loads the plan's model: the generation path's
    open_backend for it (gemmactl/generate.py), so the run is placed as the plan says and nothing else.
    """
    from gemmactl.machine import detect_machine
    from gemmactl.plan.auto import gpu_capable_library
    from gemmactl.plan.profile import machine_profile
    from gemmactl.runtime.base import GenerationRequest, GenerationStats, GpuPlacement, stream_generate
    from gemmactl.store import Store

    store = store or Store()
    machine = detect_machine()
    usable_gpu = bool(machine.gpus) and gpu_capable_library(store)
    if usable_gpu:
        n_gpu_layers, predicted, placement = plan.placement.n_gpu_layers, plan.decode_tok_s, "plan"
    else:
        here, _ = machine_profile(store.home / "plan", machine)
        here = replace(here, vram_bytes=0)
        cpu_plan = evaluate(plan.inventory, here, Budget(0, plan.budget.ram_bytes), Placement(0), plan.context, plan.parallel)
        n_gpu_layers, predicted, placement = 0, cpu_plan.decode_tok_s, "cpu (no usable GPU here)"
    if announce is not None:
        where = f"with {n_gpu_layers} GPU layers as planned" if usable_gpu else "on the CPU (no usable GPU here)"
        announce(f"loading the model {where}, then decoding {VERIFY_TOKENS} tokens greedily")
    request = GenerationRequest(prompt=VERIFY_PROMPT, max_tokens=VERIFY_TOKENS, temperature=0.0, raw=True)
    with GpuMemorySampler() as sampler:
        overrides = _overrides(plan) if usable_gpu else ()
        backend = open_backend(
            context=plan.context * plan.parallel,
            placement=GpuPlacement(True, f"plan --verify: {placement}", n_gpu_layers, overrides),
            extra_args={"swa_full": False, "n_ubatch": 512},
        )
        try:
            stats = [event for event in stream_generate(backend, request) if isinstance(event, GenerationStats)][-1]
            timings = backend.engine_timings()
        finally:
            backend.close()
    measured = timings.decode_tokens / timings.decode_s if timings and timings.decode_s else (stats.decode_tok_s or 0.0)
    budget = plan.budget.vram_bytes
    return VerifyResult(
        n_gpu_layers=n_gpu_layers,
        tensor_overrides_applied=bool(usable_gpu and _overrides(plan)),
        predicted_decode_tok_s=round(predicted, 2),
        measured_decode_tok_s=round(measured, 2),
        decode_tokens=timings.decode_tokens if timings else 0,
        peak_gpu_bytes=sampler.peak,
        budget_vram_bytes=budget,
        within_budget=sampler.peak <= budget,
        placement=placement,
    )


def verify_engine_plan(result, open_backend: Callable[..., Backend], *, store=None,
                       announce: Callable[[str], None] | None = None) -> VerifyResult:
    """The int4 engine with the plan's map (result: a plan/report.PlanResult of an int4-stream
    artifact), VERIFY_TOKENS tokens decoded greedily, against the map's predicted rate.

    open_backend(context=, placement=, kv_cache=, draft=) loads the artifact through the generation
    path; a plan made with a draft loads it too (the prediction is the model's alone).
    Without CUDA here, every layer runs on the CPU and the prediction is the engine's all-CPU
    cost with this machine's measured profile.
    """
    import torch

    from gemmactl.machine import detect_machine
    from gemmactl.plan.auto import placement_of
    from gemmactl.plan.engine_map import cpu_decode_tok_s
    from gemmactl.plan.profile import machine_profile
    from gemmactl.runtime.base import GenerationRequest, GenerationStats, stream_generate
    from gemmactl.store import Store

    plan, chosen = result.plan, result.engine
    store = store or Store()
    machine = detect_machine()
    kv_mode = chosen.kv_mode if chosen is not None else None
    if chosen is not None and torch.cuda.is_available():
        placement, where = placement_of(chosen, plan.profile), "plan"
        predict = chosen.decode_tok_s_at
    else:
        here, _ = machine_profile(store.home / "plan", machine)
        placement, where = None, "cpu (no usable GPU here)"

        def predict(position: int) -> float:
            return cpu_decode_tok_s(result.model_path, here, plan.context, kv_mode, position)
    layers = placement.layers if placement is not None else ()
    counts = {kind: sum(1 for k in layers if k == kind) for kind in ("resident", "streamed", "host")}
    if placement is None:
        counts["host"] = plan.inventory.shape.n_layers
    if announce is not None:
        said = placement.summary() if placement is not None else "every layer on the CPU (no usable GPU here)"
        announce(f"loading the artifact in the engine with {said}, then decoding {VERIFY_TOKENS} tokens greedily")
    request = GenerationRequest(prompt=VERIFY_PROMPT, max_tokens=VERIFY_TOKENS, temperature=0.0, raw=True)
    draft = None
    if result.draft is not None:  # loaded as `run --draft` loads it, in the room the map kept
        from gemmactl.runtime.engine.draft import DraftSettings

        draft = DraftSettings(str(result.draft.path), result.draft.k_max)
    with GpuMemorySampler() as sampler, _engine_device("cpu" if placement is None else None):
        backend = open_backend(context=plan.context, placement=placement, kv_cache=kv_mode, draft=draft)
        try:
            stats = [event for event in stream_generate(backend, request) if isinstance(event, GenerationStats)][-1]
            timings = backend.engine_timings()
        finally:
            backend.close()
    # The engine's own timer covers a generation it finished itself; one the caller stopped at
    # max_tokens has the stream's decode figures (tokens after the first over the time after it).
    if timings and timings.decode_s:
        measured, decoded = timings.decode_tokens / timings.decode_s, timings.decode_tokens
    else:
        measured, decoded = stats.decode_tok_s or 0.0, max(stats.generated_tokens - 1, 0)
    # predicted where the decode ran: the cache filled to the prompt and half the tokens decoded
    predicted = predict(stats.prompt_tokens + decoded // 2)
    budget = plan.budget.vram_bytes
    return VerifyResult(
        n_gpu_layers=counts["resident"],
        tensor_overrides_applied=False,
        predicted_decode_tok_s=round(predicted, 2),
        measured_decode_tok_s=round(measured, 2),
        decode_tokens=decoded,
        peak_gpu_bytes=sampler.peak,
        budget_vram_bytes=budget,
        within_budget=sampler.peak <= budget,
        placement=where,
        engine_layers=counts,
    )


@contextmanager
def _engine_device(device: str | None):
    """The engine's device for the load inside (None: its own choice)."""
    from gemmactl.runtime.engine.backend import DEVICE_ENV

    before = os.environ.get(DEVICE_ENV)
    if device is not None:
        os.environ[DEVICE_ENV] = device
    try:
        yield
    finally:
        if device is not None:
            if before is None:
                os.environ.pop(DEVICE_ENV, None)
            else:
                os.environ[DEVICE_ENV] = before


def _overrides(plan: Plan) -> tuple[str, ...]:
    from gemmactl.plan.llama_args import tensor_overrides

    return tensor_overrides(plan)
