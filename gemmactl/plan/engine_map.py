"""The engine's map: which layers of an int4-stream artifact stay on the GPU, stream, or run on the CPU.

Sizes are the engine's own (runtime/engine/kernels.linear_bytes: int4 in tinygemm's layout, the
rest bfloat16; on the host, as torch's CPU kernels hold them), read from the artifact's index.
The GPU holds, in this order of need: the CUDA context (the profile's reserve), the head and the
per-layer-input projection, every KV cache of a layer on the GPU (sliding layers their window),
a working area for prefill chunks, then as many layers as fit. With layers left over, two
staging areas of the largest streamed layer are kept too, and each leftover layer is either

- streamed: its int4 bytes cross the host link (pinned copies on their own stream) while the GPU
  computes the layers before it, or
- host: the CPU runs it in torch's int4/int8 kernels, reading its bytes at the profile's
  host_kernel_bandwidth, plus its eager operations' dispatch (profile.engine_host_layer_s), the
  activations crossing the link both ways (HOST_CROSSING_S). Only a layer whose KV cache is its
  own and read by no other layer (its cache stays on the host).

The link and the CPU work side by side: while the CPU runs its layers, the next streamed layer's
copy crosses. So the split is chosen by playing the engine's schedule out (_schedule_seconds) for
every count of host layers, spread evenly among those that may (_split_leftover). The resident
layers are spread between the streamed ones, so the copies run beside the GPU's compute. A dense
model's step is captured in CUDA graphs, whole or in pieces around its host layers
(runtime/engine/graph_host.py); an MoE model puts no layer on the host (its step would run
eagerly). Embedding tables go to host memory first when the whole does not fit: only the current
tokens' rows cross the link. The predicted decode rate adds the head's read and the attention's
reads of the KV caches: each layer reads the cache it attends to (its own, or the one it shares)
at the bandwidth of the device holding it, a sliding layer's window at most. A captured step
reads every slot of every cache, written or not, so its rate is the same at any position and
`decode_tok_s` is it; an eager step reads the slots written so far, and `decode_tok_s_at(position)`
grows its reads with the conversation (`decode_tok_s` is then its rate with the caches full). For
an E4B shape at 32K in bfloat16 the global layers read about 0.9 GB a step: little beside a 4 GB
card's streamed layers, but milliseconds a token on a card of a few hundred GB/s, and a
quantized KV mode reads half or less.

MoE experts are not part of a layer's cost: they live in host memory (runtime/engine/experts.py),
and whatever room the layers leave becomes the expert cache (whole experts, none past the count),
beside EXPERT_SCRATCH_ROWS experts' room that misses the cache does not keep are copied into, and
top_k more for the staging rows of a decode step captured in graphs.
Experts are sized as the engine holds them: int4 in tinygemm's layout, columns padded.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from gemmactl.errors import BudgetTooSmallError
from gemmactl.formats.int4.spec import HEAD_NAME
from gemmactl.runtime.engine.expert_settings import EXPERT_SCRATCH_ROWS
from gemmactl.sizes import format_size

CHUNK_TOKENS = 256  # the engine's prefill chunk (runtime/engine/backend.CHUNK)
LINK_LATENCY_S = 10e-6  # one small host↔device copy
# The activations crossing between the GPU and the CPU, each way: a small copy's latency, and the
# host's wait for it (GPU → CPU) or the next graph's launch (CPU → GPU). An estimate.
HOST_CROSSING_S = 30e-6
HOST_LAYERS_ENV = "GEMMACTL_PLAN_HOST_LAYERS"  # auto (default) | off: no layer on the CPU (for comparisons)
# A captured MoE step waits for the host at each MoE layer (graph_moe.PiecewiseDecode: the router's
# choice read back, the cache looked up, the layer's copies queued, the next piece launched), and a
# layer's misses start crossing only then. Fitted to the engine on an H200 (26B-A4B shape, 4 GiB,
# uniform router): 28.3 and 29.1 tok/s measured where the map without this term predicted 64.3,
# 0.63 ms a layer over 30 layers (docs/benchmarks.md).
MOE_LAYER_WAIT_S = 0.63e-3
# An expert homed on the CPU (runtime/engine/experts.py, ExpertStore.set_homes), one token: its two
# products in torch's CPU int4 kernel at the profile's kernel rate, plus this much more: the
# activation and copies around them on the host and the staging row the captured piece computes
# for nothing. Fitted on an H100 machine (16 cores; 26B-A4B shape, 4 GiB, uniform router): a homed
# expert cost the step 143-148 µs at shares 0.5 to 0.75, counting back the link time it saved at
# 55 GB/s, where its products alone took 57 in the step's profile (docs/benchmarks.md). Priced so,
# the steps the map predicts grow as the measured ones did: a layer pays its host's work and its
# copies one after the other, not the longer of the two.
EXPERT_HOST_S = 90e-6
SHARE_STEPS = 16  # the plan tries the shares 0, 1/16, ..., 1 of each layer's experts on the CPU
SHARE_GAIN = 1.05  # ... and homes experts only where that predicts at least this much more than none
# A dense layer's fixed cost on the GPU in a step captured without compile fusion: graph.wanted
# fuses only a step whose every layer is on the GPU (its tables on the GPU or in host memory), so a
# step with streamed layers or layers on the host runs each operation as a kernel of its own.
# The profile's gpu_layer_latency_s (60 µs) is the fused step's; an unfused layer pays this many
# times it: 222 µs, fitted to an E4B-shaped map with every layer resident and the tables in host
# memory on an H100 captured unfused, 96.2 tok/s measured where 60 µs a layer predicted 277 (that
# step is fused now: 220 tok/s; docs/benchmarks.md). MoE maps keep the fused figure:
# MOE_LAYER_WAIT_S was fitted beside it.
ENGINE_UNFUSED_FACTOR = 3.7
# Small buffers and the freed blocks torch's allocator keeps for reuse (61 MiB at the E4B engine's
# peak, expandable segments on; benchmarks/engine_memory.py). Nothing in it grows with the context:
# the engine once kept rope tables for every position (12 MiB for E4B at 4096, 96 MiB at 32K, which
# broke a 3,136 MiB budget by 52 MiB there) and now makes each step's rows (spec.rope_rows).
MARGIN_BYTES = 128 << 20
# An MoE model's captured step holds more: the 26B-A4B engine at a 4,096 MiB cap peaked at
# 4,107–4,109 MiB on an H100 (2026-12-07) with 128 alone, 40 MiB above the same map's runs on
# another H100 hours before, with the MoE step's later changes (one kernel for every expert product,
# the staged warm-up before capture, two sets of ahead rows), and 60 with the expert cache off. The
# cause is not isolated, so 64 MiB more for MoE maps, not yet measured (docs/benchmarks.md).
MOE_MARGIN_BYTES = 64 << 20
EXPERT_SCRATCH_NOTE = ", the experts' scratch and staging rows"


@dataclass
class LayerCost:
    index: int
    device_bytes: int  # weights in the GPU kernels' layout
    dense_bytes: int  # weights as the CPU holds them (a host layer reads them: its kernels' int4/int8, or bfloat16)
    kv_bytes: int
    shared: bool  # other layers read its KV cache
    borrows: bool = False  # it reads another layer's KV cache

    @property
    def may_run_on_host(self) -> bool:
        """Whether the layer can run on the CPU: its KV cache is its own and no other layer reads
        it (a cache read across the link would cross it every token)."""
        return not self.shared and not self.borrows


@dataclass
class EngineMap:
    layers: tuple[str, ...]
    tables_on_host: bool
    gpu_bytes: dict[str, int] = field(default_factory=dict)  # reserve, globals, kv, work, layers, staging
    host_bytes: int = 0
    link_bytes_per_token: int = 0
    decode_tok_s: float = 0.0
    minimum_vram_bytes: int = 0
    reason: str = ""
    expert_cache_bytes: int | None = None  # MoE models: device bytes of the experts cached at the map's share
    expert_room_bytes: int | None = None  # ... and the room for cached experts at any share (what the engine gets)
    expert_bytes: int = 0  # one expert in the device layout
    experts: int = 0  # experts in the model (every MoE layer)
    expert_cpu_share: float = 0.0  # the share of each MoE layer's experts computed on the CPU, always
    kv_mode: str = "bf16"  # the KV caches' mode the map was sized for
    context: int = 0  # the context the map was sized for
    kv_reads: tuple[tuple[int, float], ...] = ()  # (slots at most, seconds per filled slot) of a step's cache reads
    captured: bool = True  # the step runs in a CUDA graph (no layer on the CPU): every cache slot is read
    empty_tok_s: float = 0.0  # the rate with nothing in the caches (an eager step's start)
    longest_resident: int | None = None  # with --context max: the longest context keeping every layer on the GPU

    def decode_tok_s_at(self, position: int) -> float:
        """The predicted decode rate with the caches filled to position tokens."""
        return self.decode_tok_s if self.captured else _with_reads(self.empty_tok_s, self.kv_reads, position)

    @property
    def gpu_total(self) -> int:
        return sum(self.gpu_bytes.values())

    def to_dict(self) -> dict:
        counts = {kind: self.layers.count(kind) for kind in ("resident", "streamed", "host")}
        return {"layers": list(self.layers), "counts": counts, "tables": "host" if self.tables_on_host else "gpu",
                "gpu_bytes": {**self.gpu_bytes, "total": self.gpu_total}, "host_bytes": self.host_bytes,
                "link_bytes_per_token": self.link_bytes_per_token, "decode_tok_s": round(self.decode_tok_s, 2),
                "decode_tok_s_start": round(self.decode_tok_s_at(0), 2), "captured": self.captured, "context": self.context,
                "minimum_vram_bytes": self.minimum_vram_bytes, "reason": self.reason, "kv_cache": self.kv_mode,
                **({"longest_resident_context": self.longest_resident} if self.longest_resident is not None else {}),
                **({"experts": {"count": self.experts, "expert_bytes": self.expert_bytes,
                                "cache_bytes": self.expert_cache_bytes, "cpu_share": self.expert_cpu_share,
                                "cached": self.expert_cache_bytes // self.expert_bytes}} if self.experts else {})}


def _costs(index: dict, spec, context: int, kv_mode: str | None = None, spare_slots: int = 0
           ) -> tuple[list[LayerCost], dict[str, int], dict[str, int]]:
    """Per-layer costs, the GPU-side globals and the tables, from the artifact's index. spare_slots:
    ring slots past a sliding layer's window (speculation's drafted tokens, runtime/engine/model.py)."""
    from gemmactl.runtime.engine.kernels import linear_bytes
    from gemmactl.runtime.engine.kv_modes import layer_mode, pair_bytes

    layers = {layer.index: [0, 0] for layer in spec.layers}
    globals_ = {"head": 0, "projection": 0, "norms": 0}
    tables = {"token": 0, "per_layer": 0}
    experts: dict = {}  # (layer, expert) → device bytes
    names = set()
    for record in index.get("tensors", []):
        name, shape, scheme = record["name"], tuple(record["shape"]), record["scheme"]
        names.add(name)
        if name.endswith("embed_tokens_per_layer.weight"):
            tables["per_layer"] += int(record["nbytes"])
        elif name.endswith("embed_tokens.weight"):
            tables["token"] += int(record["nbytes"])
            if spec.tied:  # the engine makes the head from the table's record (int4 tables through tinygemm)
                globals_["head"] += linear_bytes(scheme, shape, record.get("group_size"), cuda=True)
        elif name.endswith(HEAD_NAME):
            globals_["head"] += linear_bytes(scheme, shape, record.get("group_size"), cuda=True)
        elif record.get("expert") is not None:
            key = (int(record["layer"]), int(record["expert"]))
            device, stored, dense = experts.get(key, (0, 0, 0))
            experts[key] = (device + linear_bytes(scheme, shape, record.get("group_size"), cuda=True, pad=True),
                            stored + int(record["nbytes"]), dense + 2 * _count(shape))
        elif len(shape) == 2 and record.get("layer") is not None:
            cost = layers[int(record["layer"])]
            cost[0] += linear_bytes(scheme, shape, record.get("group_size"), cuda=True)
            cost[1] += linear_bytes(scheme, shape, record.get("group_size"), cuda=False)
        elif len(shape) == 2:
            globals_["projection"] += linear_bytes(scheme, shape, record.get("group_size"), cuda=True)
        else:
            globals_["norms"] += 4 * _count(shape)
    readers = {layer.kv_from for layer in spec.layers if not layer.owns_kv}
    costs = []
    for layer in spec.layers:
        kv = 0
        if layer.owns_kv:
            slots = _slots(spec, layer, context, spare_slots)  # K and V per slot and head, and its position
            kv = slots * layer.kv_heads * pair_bytes(layer_mode(kv_mode, layer.kind), layer.head_dim) + slots * 8
        device_bytes, dense_bytes = layers[layer.index]
        costs.append(LayerCost(layer.index, device_bytes, dense_bytes, kv, layer.index in readers, not layer.owns_kv))
    tables["experts"] = experts
    return costs, globals_, tables


def _count(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _work_bytes(spec, context: int, kv_mode: str | None = None, spare_slots: int = 0) -> int:
    """Prefill activations of one chunk (the widest MLP, three live copies), the logits, and the
    chunk's attention scores against a full cache, taken in blocks of query rows (8 bytes a
    score: bfloat16 scores, their masked copy, the float32 softmax; runtime/engine/spec.score_rows).
    The scores were left out of the first plans: 64 MiB for an E4B shape at 4096, unblocked. And
    a quantized KV cache's largest read (_read_bytes)."""
    from gemmactl.runtime.engine.spec import SCORE_BYTES, score_rows

    heads = max((layer.heads for layer in spec.layers), default=0)
    reads = _read_bytes(spec, context, kv_mode, spare_slots)
    # A quantized cache is read a block of slots at a time, and its read's scores are one block's
    # (counted in reads), never the whole context's: counting both kept 32 MiB too many for an E4B
    # shape, about 7,700 tokens of its tq4 cache.
    scores = 0 if reads else min(CHUNK_TOKENS, score_rows(heads, context)) * heads * context * SCORE_BYTES
    return (CHUNK_TOKENS * spec.hidden * 2 * 8 + CHUNK_TOKENS * 4 * spec.hidden * 2 * 3 * 2 + spec.vocab * 4 * 2
            + scores + reads)


def _read_bytes(spec, context: int, kv_mode: str | None, spare_slots: int) -> int:
    """The largest attention read of a quantized cache by a prefill chunk: one block of slots
    decoded, its scores and the running softmax (runtime/engine/kv_modes.read_bytes; none for
    bf16). Before reads went by blocks, an E4B shape with tq4 at 32K under 4 GiB went 0.34 GiB over."""
    from gemmactl.runtime.engine.kv_modes import layer_mode, read_bytes

    owners = {layer.index: layer for layer in spec.layers}
    return max((read_bytes(layer_mode(kv_mode, owners[reader.kv_from].kind), _slots(spec, reader, context, spare_slots),
                           reader.heads, reader.kv_heads, reader.head_dim, CHUNK_TOKENS)
                for reader in spec.layers), default=0)


def _slots(spec, layer, context: int, spare_slots: int) -> int:
    """Slots of a layer's KV cache: a sliding layer's ring (its window and spare_slots) when that is
    shorter than the context, else the context (runtime/engine/model.py)."""
    ring = layer.kind == "sliding_attention" and 0 < spec.window and spec.window + spare_slots < context
    return spec.window + spare_slots if ring else context


def longest_context(artifact: Path, profile, vram_bytes: int, kv_mode: str | None = None, step: int = 256,
                    draft=None) -> int:
    """The longest context (a multiple of step, up to the model's own) the engine can run in the
    budget at all: its least-that-works map fits. Raises BudgetTooSmallError when not even step
    tokens do."""
    plan_engine(artifact, profile, vram_bytes, step, kv_mode, draft)  # raises with the minimum when nothing fits

    def fits(context: int) -> bool:
        try:
            plan_engine(artifact, profile, vram_bytes, context, kv_mode, draft)
        except BudgetTooSmallError:
            return False
        return True

    return _last_context(artifact, step, fits)


def _last_context(artifact: Path, step: int, holds) -> int:
    """The last multiple of step, up to the model's own context, at which holds(context) is true,
    given that it holds at step and, once false, stays false."""
    from gemmactl.formats.int4.reader import read_index
    from gemmactl.runtime.engine.spec import hf_text_config

    config = read_index(Path(artifact)).get("config") or {}
    low, high = step, max(step, int(hf_text_config(config).max_position_embeddings) // step * step)
    while low < high:
        middle = (low + high + step) // 2 // step * step
        if holds(middle):
            low = middle
        else:
            high = middle - step
    return low


def longest_resident_context(artifact: Path, profile, vram_bytes: int, kv_mode: str | None = None,
                             step: int = 256, draft=None) -> int:
    """The longest context (a multiple of step, up to the model's own) at which the engine's map
    keeps every layer on the GPU: the longest it decodes without a layer crossing the link or
    running on the CPU. Past it the engine still runs (longest_context), streaming layers for the
    cache's room. 0 where not even step tokens keep every layer there."""
    def all_resident(context: int) -> bool:
        try:
            chosen = plan_engine(artifact, profile, vram_bytes, context, kv_mode, draft)
        except BudgetTooSmallError:
            return False
        return all(kind == "resident" for kind in chosen.layers)

    return _last_context(artifact, step, all_resident) if all_resident(step) else 0


def plan_engine_or_say_the_longest(artifact: Path, profile, vram_bytes: int, context: int,
                                   kv_mode: str | None = None, draft=None) -> EngineMap:
    """plan_engine; when the context is what does not fit, the error names the longest that does."""
    try:
        return plan_engine(artifact, profile, vram_bytes, context, kv_mode, draft)
    except BudgetTooSmallError as exc:
        try:
            longest = longest_context(artifact, profile, vram_bytes, kv_mode, draft=draft)
        except BudgetTooSmallError:
            raise exc from None
        if longest >= context:
            raise
        raise BudgetTooSmallError(f"{exc.message}; at this budget the longest context that fits is {longest}",
                                  hint=f"Use --context {longest} or less, or a KV cache mode that keeps less "
                                       f"(--kv-cache int8, tq4, tq3). {exc.hint}") from None


HOST_MARGIN_BYTES = 2 << 30  # beside what the map keeps in host memory: the process itself and the system


def check_host_memory(chosen: EngineMap, ram_bytes: int | None, given: bool = False) -> None:
    """Raise BudgetTooSmallError, before anything is loaded, where the host memory the map keeps
    (every MoE expert as stored, pinned on a GPU machine; the embedding tables; the layers off the
    GPU) and HOST_MARGIN_BYTES for the process do not fit the RAM. given: the RAM came from --ram."""
    if not ram_bytes or chosen.host_bytes + HOST_MARGIN_BYTES <= ram_bytes:
        return
    parts = "the MoE experts as stored, the embedding tables" if chosen.experts else "the embedding tables"
    if any(kind != "resident" for kind in chosen.layers):
        parts += " and the layers off the GPU"
    where = "the RAM given" if given else "this machine's RAM"
    raise BudgetTooSmallError(
        f"the engine keeps {format_size(chosen.host_bytes)} of this model in host memory ({parts}); with "
        f"{format_size(HOST_MARGIN_BYTES)} for the process, {where} ({format_size(ram_bytes)}) is not enough",
        hint=f"Run it where there are at least {format_size(chosen.host_bytes + HOST_MARGIN_BYTES)} of RAM"
             + (" (--ram)" if given else "") + ", or run a smaller model.")


@dataclass(frozen=True)
class DraftNeed:
    """A speculative draft beside the model: its artifact (loaded whole on the GPU, its KV caches
    included) and the most tokens it drafts a round (ring slots both models keep past the window)."""

    path: Path
    k_max: int


def draft_gpu_bytes(draft: DraftNeed, profile, context: int, kv_mode: str | None = None) -> int:
    """What the draft holds on the GPU: its every-layer-resident map less the CUDA context, which
    the model's map already reserves (one process, one context), and less its embedding tables,
    which the draft keeps in host memory (runtime/engine/draft.draft_placement)."""
    chosen = plan_engine(draft.path, profile, 1 << 50, context, kv_mode, spare_slots=draft.k_max)
    return chosen.gpu_total - chosen.gpu_bytes["reserve"] - chosen.gpu_bytes["tables"]


def plan_engine(artifact: Path, profile, vram_bytes: int, context: int, kv_mode: str | None = None,
                draft: DraftNeed | None = None, *, spare_slots: int = 0) -> EngineMap:
    """The engine's map for an int4-stream artifact under a VRAM budget (profile: the machine's),
    its KV caches sized for kv_mode (runtime/engine/kv_modes.py; default bf16). With a draft, its
    GPU bytes come off the budget first and the model's rings keep the draft's spare slots."""
    index, spec = _index_and_spec(artifact)
    reserved = 0
    if draft is not None:
        reserved = draft_gpu_bytes(draft, profile, context, kv_mode)
        spare_slots = max(spare_slots, draft.k_max)
    chosen = _plan(index, spec, profile, vram_bytes, context, kv_mode, spare_slots, reserved)
    chosen.kv_mode, chosen.context = kv_mode or "bf16", context
    chosen.kv_reads = _kv_reads(spec, chosen.layers, profile, context, kv_mode, spare_slots)
    # Captured: whole, or in pieces around the host layers (a dense model); an MoE model with
    # layers on the host runs eagerly. The host layers' reads are counted at the full context too.
    chosen.captured = "host" not in chosen.layers or not chosen.experts
    chosen.empty_tok_s = chosen.decode_tok_s
    chosen.decode_tok_s = _with_reads(chosen.empty_tok_s, chosen.kv_reads, context)
    return chosen


def _kv_reads(spec, kinds, profile, context: int, kv_mode: str | None, spare_slots: int = 0,
              ) -> tuple[tuple[int, float], ...]:
    """What one decode step's attention reads cost per filled slot, by how many slots a cache holds
    (a sliding ring's, or the context): each layer reads the cache it attends to (its own or the
    one it shares), at the bandwidth of the device that cache lives on, the host's for a layer on
    the CPU (kinds: the map's layers; "host" everywhere for an engine on the CPU alone)."""
    from gemmactl.runtime.engine.kv_modes import layer_mode, pair_bytes

    by_cap: dict[int, float] = {}
    owners = {layer.index: layer for layer in spec.layers}
    for layer in spec.layers:
        owner = owners[layer.kv_from]
        bandwidth = profile.cpu_bandwidth if kinds[owner.index] == "host" else profile.gpu_bandwidth
        cap = _slots(spec, owner, context, spare_slots)
        per_slot = owner.kv_heads * pair_bytes(layer_mode(kv_mode, owner.kind), owner.head_dim)
        by_cap[cap] = by_cap.get(cap, 0.0) + per_slot / bandwidth
    return tuple(sorted(by_cap.items()))


def _with_reads(rate: float, reads, position: int) -> float:
    """A decode rate with an empty cache, slowed by the cache reads at position."""
    extra = sum(min(position, cap) * seconds for cap, seconds in reads)
    return 1.0 / (1.0 / rate + extra) if rate > 0 else 0.0


def _index_and_spec(artifact: Path):
    """The artifact's index and the model's shape read from it."""
    from gemmactl.formats.int4.reader import read_index
    from gemmactl.runtime.engine.spec import model_spec

    index = read_index(Path(artifact))
    shapes = {r["name"]: tuple(r.get("stack_shape") or r["shape"]) for r in index.get("tensors", [])}
    return index, model_spec(index.get("config") or {}, shapes)


def _plan(index: dict, spec, profile, vram_bytes: int, context: int, kv_mode: str | None, spare_slots: int = 0,
          draft_bytes: int = 0) -> EngineMap:
    costs, globals_, tables = _costs(index, spec, context, kv_mode, spare_slots)
    experts = tables.pop("experts")
    gpu_bw, link = profile.gpu_bandwidth, profile.host_to_device
    fixed = {"reserve": profile.gpu_reserve_bytes, "globals": sum(globals_.values()),
             "work": _work_bytes(spec, context, kv_mode, spare_slots) + MARGIN_BYTES}
    if draft_bytes:
        fixed["draft"] = draft_bytes
    top_k = 0
    if experts:  # the rows misses the cache does not keep are copied into, and the captured step's
        # staging rows, one per expert a token reads (runtime/engine/expert_arena.py)
        from gemmactl.runtime.engine.spec import hf_text_config

        top_k = int(hf_text_config(index.get("config") or {}).top_k_experts)
        fixed["expert_scratch"] = (EXPERT_SCRATCH_ROWS + top_k) * max(device for device, _, _ in experts.values())
        fixed["work"] += MOE_MARGIN_BYTES
    kv_all = sum(c.kv_bytes for c in costs)
    table_bytes = sum(tables.values())

    fused = profile.gpu_layer_latency_s  # every layer on the GPU: the step is fused
    unfused = fused if experts else fused * ENGINE_UNFUSED_FACTOR

    def resident_time(c: LayerCost, latency: float = unfused) -> float:
        return c.device_bytes / gpu_bw + latency

    def streamed_time(c: LayerCost) -> float:
        return max(c.device_bytes / link, c.device_bytes / gpu_bw) + unfused

    host_bw = profile.host_kernel_bandwidth
    # A dense model's step is captured around its host layers (runtime/engine/graph_host.py); an
    # MoE model's would run eagerly whole, its GPU layers' launches unpaid here: none go to the host.
    hosting = not experts and os.environ.get(HOST_LAYERS_ENV, "auto").lower() not in ("off", "0", "false")

    def host_time(c: LayerCost) -> float:
        return c.dense_bytes / host_bw + profile.engine_host_layer_s(c.dense_bytes)

    def may_host(c: LayerCost) -> bool:
        return hosting and c.may_run_on_host

    head_time = globals_["head"] / gpu_bw
    largest = max(c.device_bytes for c in costs)
    # The least that works: nothing resident, tables in RAM, staging for the largest layer.
    minimum = sum(fixed.values()) + kv_all + 2 * largest
    layers_total = sum(c.device_bytes for c in costs)
    # Tables on the GPU save only their rows' crossing per token; an MoE model's cached experts
    # are worth far more of the same room, so its tables stay in host memory.
    for tables_on_host in ((True,) if experts else (False, True)):
        need = sum(fixed.values()) + kv_all + layers_total + (0 if tables_on_host else table_bytes)
        if need <= vram_bytes:
            gpu = {**fixed, "kv": kv_all, "tables": 0 if tables_on_host else table_bytes, "layers": layers_total, "staging": 0}
            rate = 1.0 / (sum(resident_time(c, fused) for c in costs) + head_time)
            where = "in host memory" if tables_on_host else "on the GPU"
            return _with_experts(EngineMap(("resident",) * len(costs), tables_on_host, gpu,
                                           table_bytes if tables_on_host else 0, _row_bytes(index) if tables_on_host else 0,
                                           rate, minimum, f"engine plan: every layer on the GPU, tables {where} "
                                           f"({format_size(need)} of {format_size(vram_bytes)})"),
                                 experts, vram_bytes, profile, top_k)
    if minimum > vram_bytes:
        draft = f", the draft's {format_size(draft_bytes)}" if draft_bytes else ""
        raise BudgetTooSmallError(
            f"the engine needs at least {format_size(minimum)} of GPU memory for this model at context {context} "
            f"(CUDA context, head, KV caches, two staging areas of {format_size(largest)}{draft}"
            f"{EXPERT_SCRATCH_NOTE if experts else ''}); "
            f"the budget is {format_size(vram_bytes)}",
            hint=f"Give it {format_size(minimum)} or more, or a smaller --context"
                 + (", or leave out the draft." if draft_bytes else "."),
        )
    room = vram_bytes - sum(fixed.values()) - kv_all - 2 * largest
    # Layers whose GPU residence saves the most time per byte go first. Streamed layers all save
    # the same (a byte less over the link), so the resident ones among equals are spread evenly
    # through the model (_spread), never bunched: see _schedule_seconds.
    def gain(c: LayerCost) -> float:  # to 4 digits, so equals stay equal through rounding
        away = min(streamed_time(c), host_time(c) if may_host(c) else float("inf"))
        return float(f"{(away - resident_time(c)) / max(c.device_bytes, 1):.4g}")

    kinds = {}
    for _, equals in sorted(_groups(costs, gain).items(), key=lambda item: -item[0]):
        chosen = _spread(equals, room)
        for c in chosen + [c for c in equals if c not in chosen]:  # then any other that still fits
            if c.device_bytes <= room:
                kinds[c.index] = "resident"
                room -= c.device_bytes

    def gpu_time(c: LayerCost) -> float:
        return c.device_bytes / gpu_bw + unfused

    def step(layers: dict) -> float:
        return _schedule_seconds(costs, layers, gpu_time, lambda c: c.device_bytes / link, host_time)

    kinds = _split_leftover(costs, kinds, may_host, step)
    streamed = [c for c in costs if kinds[c.index] == "streamed"]
    # The host layers are staged too, by a prefill chunk (runtime/engine/model.py: computed on the
    # GPU, their caches on the host), and kept in the GPU's layout in host memory beside the CPU's.
    hosted = [c for c in costs if kinds[c.index] == "host"]
    staging = 2 * max((c.device_bytes for c in streamed + hosted), default=0)
    host_kv = sum(c.kv_bytes for c in costs if kinds[c.index] == "host")
    layers = tuple(kinds[c.index] for c in costs)
    seconds = head_time + step(kinds)
    crossings = sum(1 for a, b in zip(("resident",) + layers, layers + ("resident",)) if (a == "host") != (b == "host"))
    link_bytes = sum(c.device_bytes for c in streamed) + _row_bytes(index) + crossings * spec.hidden * 2
    gpu = {**fixed, "kv": kv_all - host_kv, "tables": 0,
           "layers": sum(c.device_bytes for c in costs if kinds[c.index] == "resident"), "staging": staging}
    host = table_bytes + sum(c.device_bytes for c in streamed) + sum(c.dense_bytes + c.device_bytes for c in hosted)
    counts = {kind: layers.count(kind) for kind in ("resident", "streamed", "host")}
    reason = (f"engine plan: {counts['resident']} layers on the GPU, {counts['streamed']} streamed, {counts['host']} on the CPU, "
              f"tables in host memory ({format_size(sum(gpu.values()))} of {format_size(vram_bytes)})")
    return _with_experts(EngineMap(layers, True, gpu, host, link_bytes, 1.0 / seconds, minimum, reason), experts,
                         vram_bytes, profile, top_k)


def _groups(costs: list, key) -> dict:
    """The costs by key, each group in layer order."""
    groups: dict = {}
    for c in costs:
        groups.setdefault(key(c), []).append(c)
    return groups


def _spread(layers: list, room: int) -> list:
    """Layers (in layer order) to keep resident in room bytes, spread evenly among them: walking the
    layers, each adds its share of the room (room ÷ their bytes, of its own bytes) to a balance,
    and a layer is kept once the balance reaches half of it (then paid from the balance). At about
    half the bytes the resident layers alternate with the streamed ones; never the lower ones alone."""
    total = sum(c.device_bytes for c in layers)
    share = min(1.0, room / total) if total else 0.0
    chosen, balance = [], 0.0
    for c in layers:
        balance += share * c.device_bytes
        if balance >= c.device_bytes / 2 and c.device_bytes <= room:
            chosen.append(c)
            balance -= c.device_bytes
            room -= c.device_bytes
    return chosen


def _split_leftover(costs: list, kinds: dict, may_host, step) -> dict:
    """kinds with every layer not resident streamed or on the host, as the step is fastest: for
    each count of host layers (none up to every one that may run there), that many spread evenly
    among those that may, the rest streamed; step(kinds) prices each. The link and the CPU work
    side by side (_schedule_seconds), so the best split is rarely all of one."""
    leftover = [c for c in costs if c.index not in kinds]
    candidates = [c for c in leftover if may_host(c)]
    best = None
    for count in range(len(candidates) + 1):
        hosted = {candidates[int((i + 0.5) * len(candidates) / count)].index for i in range(count)} if count else set()
        trial = {**kinds, **{c.index: "host" if c.index in hosted else "streamed" for c in leftover}}
        seconds = step(trial)
        if best is None or seconds < best[0] * (1 - 1e-9):
            best = (seconds, trial)
    return best[1] if best is not None else kinds


def _schedule_seconds(costs: list, kinds: dict, gpu_time, copy_time, host_time) -> float:
    """A decode step's time for its layers, the engine's schedule played out (graph.py,
    graph_host.py, streaming.py): the GPU and the CPU compute in layer order, each waiting for the
    other at a crossing (HOST_CROSSING_S each way); the streamed layers' copies run on their own
    stream in order, two staging areas: a copy starts once the layer two streamed layers back
    has run (its area is free) and, after a stretch of host layers, once the host has queued it
    (it queues the next copy when it reaches a streamed layer, and it waits during its own
    layers); a streamed layer runs once its copy has landed.

    So copies run beside the GPU's compute and beside the CPU's layers. (The first plans kept the
    lower layers resident and streamed the rest, and an E4B shape at a 3,136 MiB cap on an H200
    took 30.9 ms a step against 25.9 for the copies alone; the map now spreads them, _spread.)"""
    order = [c for c in costs if kinds[c.index] == "streamed"]
    landed: dict[int, float] = {}
    link_free, area_free = 0.0, [0.0, 0.0]

    def queue(p: int, at: float) -> None:
        nonlocal link_free
        link_free = max(at, link_free, area_free[p % 2]) + copy_time(order[p])
        landed[p] = link_free

    if order:
        queue(0, 0.0)
    t, p, on_host, host_free = 0.0, 0, False, 0.0
    for c in costs:
        kind = kinds[c.index]
        if (kind == "host") != on_host:
            on_host = kind == "host"
            t += HOST_CROSSING_S
            if not on_host:
                host_free = t  # the host is free to queue copies again
        if kind == "host":
            t += host_time(c)
        elif kind == "streamed":
            t = max(t, landed[p])
            if p + 1 < len(order):
                queue(p + 1, host_free)
            t += gpu_time(c)
            area_free[p % 2] = t
            p += 1
        else:
            t += gpu_time(c)
    return t + (HOST_CROSSING_S if on_host else 0.0)


def _with_experts(chosen: EngineMap, experts: dict, vram_bytes: int, profile, top_k: int) -> EngineMap:
    """The room the layers left, as whole cached experts, and what the experts add to a token's
    time (MoE models; the map unchanged otherwise). Every expert stays in host memory as stored.

    The prediction assumes routing spread evenly, so the hit rate is the cached share of the
    experts (real routing is skewed: a measured hit rate is higher). A token reads top_k experts
    in each MoE layer: from the cache at GPU bandwidth, or on a miss copied over the link or
    computed on the CPU, whichever is cheaper (runtime/engine/experts.MissRule); a share of each
    layer's experts may be homed on the CPU, computed there, in series with the link's copies
    (expert_split picks it); and each MoE layer waits for the host once (MOE_LAYER_WAIT_S).
    """
    if not experts:
        return chosen
    one = max(device for device, _, _ in experts.values())
    stored = max(s for _, s, _ in experts.values())
    dense = max(d for _, _, d in experts.values())
    room = max(0, vram_bytes - chosen.gpu_total)
    chosen.host_bytes += sum(s for _, s, _ in experts.values())
    chosen.expert_bytes, chosen.experts = one, len(experts)
    layers = len({layer for layer, _ in experts})
    share, per_token, link, slots = expert_split(len(experts), layers, top_k, room // one, one, stored, dense, profile)
    chosen.gpu_bytes["experts"] = slots * one
    chosen.expert_cache_bytes, chosen.expert_cpu_share = slots * one, share
    # The engine is handed the room, not the map's slots: run with fewer experts homed than the map
    # chose (--expert-cpu-share 0), the cache may take the room the homed experts left.
    chosen.expert_room_bytes = min(len(experts), room // one) * one
    chosen.decode_tok_s = 1.0 / (1.0 / chosen.decode_tok_s + per_token)
    chosen.link_bytes_per_token += round(link)
    # With prefetch (the engine's default) 2 × top_k of that room are its ahead rows (expert_arena.py).
    chosen.reason += (f"; room for {slots} of {len(experts)} experts on the GPU"
                      + (f" ({2 * top_k} of it prefetch's)" if slots > 2 * top_k and slots < len(experts) else ""))
    if share:
        chosen.reason += f", {share:.0%} of each MoE layer's computed on the CPU"
    return chosen


def expert_split(count: int, layers: int, top_k: int, room: int, one: int, stored: int, dense: int,
                 profile) -> tuple[float, float, float, int]:
    """(share on the CPU, seconds a token, link bytes a token, cached experts) at the share of each
    layer's experts homed on the CPU that prices a token lowest, where it beats none by SHARE_GAIN
    (the model's own error is about that size; homing moves work onto the host's cores). A layer
    pays its homed experts on the host (EXPERT_HOST_S says why beside its misses' copies, not
    overlapped with them); hits are read at GPU bandwidth, the cache holding only experts not
    homed (its hit rate their cached share, routing spread evenly); each MoE layer waits for the
    host once (MOE_LAYER_WAIT_S). Homes pay where the link is slow against the host's kernels
    (a PCIe x4 link beside a desktop's cores), not where it is about as fast (an H100 machine's
    55 GB/s, or the desktop-4g profile's PCIe 3.0 x16). Without a GPU of its own (no link) nothing
    is homed."""
    copy_s, dense_s = stored / profile.host_to_device, 2 * dense / profile.cpu_bandwidth
    host_expert_s = stored / profile.host_kernel_bandwidth + EXPERT_HOST_S
    best = None
    for step in range(SHARE_STEPS + 1 if profile.has_gpu and not profile.unified_memory else 1):
        share = step / SHARE_STEPS
        homed = round(share * count / layers) * layers
        population = count - homed
        slots = min(population, room)
        hit = slots / population if population else 0.0
        device_reads, host_reads = top_k * (1 - homed / count), top_k * homed / count  # a layer's, on average
        miss_s = min(copy_s, dense_s)
        layer_s = (device_reads * hit * one / profile.gpu_bandwidth + device_reads * (1 - hit) * miss_s
                   + host_reads * host_expert_s + MOE_LAYER_WAIT_S)
        link = layers * device_reads * (1 - hit) * stored if copy_s <= dense_s else 0.0
        if best is None or layers * layer_s < best[1] - 1e-12:
            best = (share, layers * layer_s, link, slots)
        if step == 0:
            none = best
    return best if best[1] * SHARE_GAIN <= none[1] else none


def cpu_decode_tok_s(artifact: Path, profile, context: int, kv_mode: str | None = None, position: int = 0) -> float:
    """The engine's predicted decode rate with every layer and the head on the CPU (a machine
    without a GPU): each layer costs as a host layer of the map does, without the link; the head
    and the per-layer-input projection are read as the CPU holds them too, at the rate its kernels
    reach (profile.host_kernel_bandwidth); the cache filled to position tokens."""
    from gemmactl.runtime.engine.kernels import linear_bytes

    index, spec = _index_and_spec(artifact)
    costs, _, _ = _costs(index, spec, context, kv_mode)
    dense_globals = 0
    for record in index.get("tensors", []):
        name, shape = record["name"], tuple(record["shape"])
        head = name.endswith(HEAD_NAME) or (spec.tied and name.endswith("embed_tokens.weight"))
        projection = len(shape) == 2 and record.get("layer") is None and record.get("expert") is None \
            and not name.endswith(("embed_tokens.weight", "embed_tokens_per_layer.weight", HEAD_NAME))
        if head or projection:
            dense_globals += linear_bytes(record["scheme"], shape, record.get("group_size"), cuda=False)
    rate = profile.host_kernel_bandwidth
    seconds = sum(c.dense_bytes / rate + profile.engine_host_layer_s(c.dense_bytes) for c in costs)
    reads = _kv_reads(spec, ("host",) * len(spec.layers), profile, context, kv_mode)
    return _with_reads(1.0 / (seconds + dense_globals / rate), reads, position)


def _row_bytes(index: dict) -> int:
    """Bytes of one token's rows of the tables held in host memory."""
    total = 0
    for record in index.get("tensors", []):
        if record["name"].endswith(("embed_tokens.weight", "embed_tokens_per_layer.weight")):
            total += int(record["nbytes"]) // int(record["shape"][0])
    return total
