"""The placement solver: which layers (and which layers' experts) live on the GPU, and how fast that decodes.

Placements are those llama.cpp can express: `-ngl N` puts the output layer and the last N-1
decoder layers on the GPU; for MoE, `-ot`/`--n-cpu-moe` keeps the experts of the first GPU
layers in RAM. Every candidate is priced with a bandwidth model and the fastest one that fits
both budgets wins (ties: the one using less VRAM).

Decode, per token: each layer reads its dense weights and, for MoE, only the active experts'
share (top_k / n_experts), plus its KV cache, from wherever they live, at that memory's
bandwidth, plus a fixed per-layer latency; each GPU↔CPU crossing costs one more latency.
Prefill (TTFT) of PROMPT_TOKENS: weights in RAM cross the host link once per micro-batch
(llama.cpp offloads large-batch matmuls to the GPU) and every weight is read once; compute is
2 × active parameters × tokens at the device's rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from gemmactl.errors import BudgetTooSmallError
from gemmactl.plan.inventory import Inventory, LayerInventory
from gemmactl.plan.profile import HardwareProfile

UBATCH = 512  # llama.cpp's default micro-batch: sizes the compute buffers
KV_PAD = 256  # llama.cpp pads KV cache sizes to this many cells
PROMPT_TOKENS = 512  # TTFT is predicted for a prompt of this length


@dataclass(frozen=True)
class Budget:
    vram_bytes: int
    ram_bytes: int


@dataclass(frozen=True)
class Placement:
    n_gpu_layers: int  # llama.cpp -ngl: output layer + the last n_gpu_layers-1 decoder layers
    cpu_expert_layers: tuple[int, ...] = ()  # GPU layers whose experts stay in RAM


@dataclass
class LayerPlacement:
    index: int
    device: str  # gpu | cpu
    experts_device: str | None  # None for a dense layer
    sliding: bool
    kv_cells: int
    kv_bytes: int
    bytes: dict[str, int]


@dataclass
class Plan:
    inventory: Inventory
    profile: HardwareProfile
    budget: Budget
    context: int
    parallel: int
    placement: Placement
    layers: list[LayerPlacement]
    gpu: dict[str, int]  # weights, kv, compute, reserve
    cpu: dict[str, int]
    decode_tok_s: float
    ttft_s: float
    read_per_token: dict[str, int]  # bytes read per decoded token: gpu, cpu
    notes: list[str] = field(default_factory=list)

    @property
    def gpu_bytes(self) -> int:
        return sum(self.gpu.values())

    @property
    def cpu_bytes(self) -> int:
        return sum(self.cpu.values())

    @property
    def output_on_gpu(self) -> bool:
        return self.placement.n_gpu_layers >= 1 and self.profile.has_gpu

    @property
    def fits_whole(self) -> bool:
        """Every layer, its experts and the output on the GPU."""
        return self.placement.n_gpu_layers >= self.inventory.shape.n_layers + 1 and not self.placement.cpu_expert_layers


def gpu_layer_range(n_layers: int, n_gpu_layers: int) -> range:
    """Decoder layers llama.cpp offloads for -ngl n_gpu_layers (the last ones)."""
    return range(max(n_layers + 1 - n_gpu_layers, 0), n_layers)


def kv_cells(layer: LayerInventory, shape, context: int, parallel: int, *, swa_full: bool = False) -> int:
    """Cells of one layer's KV cache: none when shared, the window (+ a micro-batch) when sliding."""
    if layer.kv_heads == 0:
        return 0
    full = _pad(context * parallel)
    if layer.sliding and shape.sliding_window and not swa_full:
        return min(full, _pad(shape.sliding_window * parallel + UBATCH))
    return full


def kv_bytes(layer: LayerInventory, cells: int) -> int:
    """The layer's K and V for cells positions, at its cache type's bytes a value (f16 unless the
    inventory says otherwise: plan/inventory.with_kv_type)."""
    return math.ceil(cells * layer.kv_heads * (layer.head_dim_k + layer.head_dim_v) * layer.kv_value_bytes)


def _pad(cells: int) -> int:
    return -(-cells // KV_PAD) * KV_PAD


def _compute_bytes(shape, *, logits: bool) -> int:
    """A compute buffer: f32 activations of one micro-batch, dominated by the logits when it holds them.

    Checked against llama.cpp's own report for Gemma 3 270M (514.5 MiB on the CPU at ubatch 512).
    """
    width = 2 * max(shape.intermediate, 2 * shape.moe_intermediate * max(shape.experts_used, 1)) + 4 * shape.hidden
    return 4 * UBATCH * ((shape.vocab if logits else 0) + width)


def _active_bytes(layer: LayerInventory, shape, *, experts: bool = True) -> float:
    dense = layer.bytes["attention"] + layer.bytes["mlp"] + layer.bytes["per_layer"]
    return dense + (_expert_share(layer, shape) if experts else 0)


def _expert_share(layer: LayerInventory, shape) -> float:
    if not shape.n_experts:
        return layer.bytes["experts"]
    return layer.bytes["experts"] * shape.experts_used / shape.n_experts


def _output_bytes(inventory: Inventory) -> int:
    """Bytes the output projection reads per token (the tied token embedding when there is no output tensor)."""
    return inventory.globals["output"] or inventory.globals["token_embd"]


def evaluate(inventory: Inventory, profile: HardwareProfile, budget: Budget, placement: Placement, context: int, parallel: int) -> Plan:
    """Memory and predicted speed of one placement."""
    shape = inventory.shape
    n = shape.n_layers
    has_gpu = profile.has_gpu and budget.vram_bytes > 0
    ngl = placement.n_gpu_layers if has_gpu else 0
    on_gpu = set(gpu_layer_range(n, ngl))
    cpu_experts = set(placement.cpu_expert_layers) & on_gpu
    output_gpu = ngl >= 1
    gpu = {"weights": 0, "kv": 0, "compute": 0, "reserve": 0}
    cpu = {"weights": 0, "kv": 0, "compute": 0}
    read_gpu = read_cpu = 0.0
    t_decode = 0.0
    prefill = _Prefill(profile, has_gpu)
    layers = []
    previous = "cpu"  # the input embedding is gathered on the CPU
    crossings = 0
    for layer in inventory.layers:
        cells = kv_cells(layer, shape, context, parallel)
        kv = kv_bytes(layer, cells)
        # Decode reads the KV cache up to the current position: on average half the context, or the window.
        kv_read = kv * min(1.0, max(context / 2, 1) / max(cells, 1)) if cells else 0.0
        device = "gpu" if layer.index in on_gpu else "cpu"
        has_experts = layer.bytes["experts"] > 0
        experts_device = None if not has_experts else ("cpu" if device == "cpu" or layer.index in cpu_experts else "gpu")
        dense = sum(layer.bytes.values()) - layer.bytes["experts"]
        active = _active_bytes(layer, shape, experts=False) + kv_read
        if device == "gpu":
            gpu["weights"] += dense
            gpu["kv"] += kv
            read_gpu += active
            t_decode += active / profile.gpu_bandwidth + profile.gpu_layer_latency_s
            prefill.add("gpu", dense, sum(layer.params.values()) - layer.params["experts"])
        else:
            cpu["weights"] += dense
            cpu["kv"] += kv
            read_cpu += active
            t_decode += active / profile.cpu_bandwidth + profile.cpu_layer_latency_s
            prefill.add("cpu", dense, sum(layer.params.values()) - layer.params["experts"])
        crossings += device != previous
        previous = device
        if has_experts:
            share = _expert_share(layer, shape)
            expert_params = layer.params["experts"] * (shape.experts_used / shape.n_experts if shape.n_experts else 1)
            if experts_device == "gpu":
                gpu["weights"] += layer.bytes["experts"]
                read_gpu += share
                t_decode += share / profile.gpu_bandwidth
            else:
                cpu["weights"] += layer.bytes["experts"]
                read_cpu += share
                t_decode += share / profile.cpu_bandwidth + profile.cpu_layer_latency_s
                crossings += 2 if device == "gpu" else 0  # out to the CPU and back within the layer
            prefill.add(experts_device, layer.bytes["experts"], expert_params)
        layers.append(LayerPlacement(layer.index, device, experts_device, layer.sliding, cells, kv,
                                     {**layer.bytes, "kv": kv}))
    g = inventory.globals
    # The input side (token and per-layer embeddings, their projection) stays on the CPU in llama.cpp.
    cpu["weights"] += g["token_embd"] + g["per_layer_embd"] + g["per_layer_proj"]
    read_cpu += g["per_layer_proj"]
    t_decode += g["per_layer_proj"] / profile.cpu_bandwidth
    out = _output_bytes(inventory) + g["output_norm"]
    if output_gpu:
        gpu["weights"] += out  # a tied embedding is loaded a second time for the output layer
        read_gpu += out
        t_decode += out / profile.gpu_bandwidth + profile.gpu_layer_latency_s
        crossings += previous != "gpu"
    else:
        cpu["weights"] += g["output"] + g["output_norm"]
        read_cpu += out
        t_decode += out / profile.cpu_bandwidth + profile.cpu_layer_latency_s
        crossings += previous != "cpu"
    if has_gpu:
        gpu["reserve"] = profile.gpu_reserve_bytes
        gpu["compute"] = _compute_bytes(shape, logits=output_gpu)
    cpu["compute"] = _compute_bytes(shape, logits=not output_gpu)
    # A crossing moves one hidden state over the host link and synchronises the two devices.
    if has_gpu:
        t_decode += crossings * (profile.gpu_layer_latency_s + 4 * shape.hidden / profile.host_to_device)
    ttft = prefill.seconds(PROMPT_TOKENS) + t_decode  # the first token is one decode step after the prompt
    return Plan(
        inventory=inventory,
        profile=profile,
        budget=budget,
        context=context,
        parallel=parallel,
        placement=Placement(ngl, tuple(sorted(cpu_experts))),
        layers=layers,
        gpu=gpu,
        cpu=cpu,
        decode_tok_s=1.0 / t_decode,
        ttft_s=ttft,
        read_per_token={"gpu": int(read_gpu), "cpu": int(read_cpu)},
    )


class _Prefill:
    """Prefill time: per micro-batch, weights are read (and RAM-resident ones cross the host link); compute on top."""

    def __init__(self, profile: HardwareProfile, has_gpu: bool):
        self.profile, self.has_gpu = profile, has_gpu
        self.parts: list[tuple[str, int, float]] = []

    def add(self, device: str, nbytes: int, params: float) -> None:
        self.parts.append((device, nbytes, params))

    def seconds(self, tokens: int) -> float:
        p = self.profile
        batches = math.ceil(tokens / UBATCH)
        total = 0.0
        for device, nbytes, params in self.parts:
            flops = 2 * params * tokens
            if device == "gpu":
                total += max(flops / p.gpu_flops, batches * nbytes / p.gpu_bandwidth)
            elif self.has_gpu and not p.unified_memory:
                total += batches * nbytes / p.host_to_device + flops / p.gpu_flops
            elif self.has_gpu:
                total += max(flops / p.gpu_flops, batches * nbytes / p.cpu_bandwidth)
            else:
                total += max(flops / p.cpu_flops, batches * nbytes / p.cpu_bandwidth)
        return total


def candidates(inventory: Inventory, profile: HardwareProfile, budget: Budget) -> list[Placement]:
    """Every placement the solver weighs: each -ngl, and for MoE each count of GPU layers with experts in RAM."""
    n = inventory.shape.n_layers
    if not (profile.has_gpu and budget.vram_bytes > 0):
        return [Placement(0)]
    moe = any(layer.bytes["experts"] for layer in inventory.layers)
    result = []
    for ngl in range(n + 2):
        gpu_layers = list(gpu_layer_range(n, ngl))
        for e in range(len(gpu_layers) + 1 if moe else 1):
            result.append(Placement(ngl, tuple(gpu_layers[:e])))
    return result


def fits(plan: Plan) -> bool:
    budget = plan.budget
    if plan.profile.unified_memory:
        return plan.gpu_bytes <= budget.vram_bytes and plan.gpu_bytes + plan.cpu_bytes <= budget.ram_bytes
    return plan.gpu_bytes <= budget.vram_bytes and plan.cpu_bytes <= budget.ram_bytes


def plan_placement(inventory: Inventory, profile: HardwareProfile, budget: Budget, *, context: int, parallel: int = 1) -> Plan:
    """The placement with the highest predicted decode speed that fits both budgets."""
    plans = [evaluate(inventory, profile, budget, c, context, parallel) for c in candidates(inventory, profile, budget)]
    feasible = [plan for plan in plans if fits(plan)]
    if not feasible:
        raise _too_small(plans, budget)
    return max(feasible, key=lambda plan: (round(plan.decode_tok_s, 6), -plan.gpu_bytes))


def _too_small(plans: list[Plan], budget: Budget) -> BudgetTooSmallError:
    from gemmactl.sizes import format_size

    ram_ok = [plan for plan in plans if plan.cpu_bytes <= budget.ram_bytes]
    if ram_ok:
        need = min(plan.gpu_bytes for plan in ram_ok)
        return BudgetTooSmallError(
            f"a VRAM budget of {format_size(budget.vram_bytes)} holds no placement of this model at this context; "
            f"the smallest needs {format_size(need)} of VRAM",
            hint=f"Pass --vram {format_size(need, unit_suffix=False)} or more, or a smaller --context.",
        )
    vram_ok = [plan for plan in plans if plan.gpu_bytes <= budget.vram_bytes] or plans
    best = min(vram_ok, key=lambda plan: plan.cpu_bytes)
    return BudgetTooSmallError(
        f"with {format_size(budget.vram_bytes)} of VRAM the model needs {format_size(best.cpu_bytes)} of RAM, "
        f"more than the {format_size(budget.ram_bytes)} budget",
        hint=f"Pass --ram {format_size(best.cpu_bytes, unit_suffix=False)} or more, more --vram, or a smaller --context.",
    )
