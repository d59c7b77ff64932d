"""The engine's map (plan/engine_map.py): what stays on the GPU, streams or runs on the CPU under a
budget, and `plan --backend int4` showing it. Sizes come from a real int4-stream artifact of a tiny
random Gemma 4 in the E2B arrangement (shared KV, per-layer inputs); the decode check runs the
chosen placement through the engine on the CPU."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import invoke
from gemmactl.errors import BudgetTooSmallError
from gemmactl.formats.int4.layout import QuantizeOptions
from gemmactl.formats.int4.quantize import quantize_checkpoint
from gemmactl.plan.engine_map import plan_engine
from gemmactl.plan.profile import load_profile

PROFILE = load_profile("desktop-4g")
CONTEXT = 256
MiB = 1 << 20


def _quantized(tmp_path_factory, kind: str):
    """A tiny random Gemma 4 of kind as an int4-stream artifact."""
    from helpers.random_gemma import build_random_gemma

    folder = tmp_path_factory.mktemp(f"engine-map-{kind}")
    source = build_random_gemma(kind, folder / "checkpoint")
    quantize_checkpoint(source, folder / "artifact", QuantizeOptions(group_size=32, shard_size=1 << 30))
    return folder / "artifact"


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return _quantized(tmp_path_factory, "e2b-tiny")


def whole(artifact):
    return plan_engine(artifact, PROFILE, 64 << 30, CONTEXT)


def test_a_model_that_fits_is_all_on_the_gpu_with_its_tables(artifact):
    chosen = whole(artifact)
    assert set(chosen.layers) == {"resident"} and not chosen.tables_on_host
    assert chosen.gpu_bytes["tables"] > 0 and chosen.link_bytes_per_token == 0 and chosen.host_bytes == 0
    assert chosen.minimum_vram_bytes < chosen.gpu_total
    assert "every layer on the GPU, tables on the GPU" in chosen.reason


def test_the_tables_leave_the_gpu_before_any_layer(artifact):
    tables = whole(artifact).gpu_bytes["tables"]
    budget = whole(artifact).gpu_total - tables + 1
    chosen = plan_engine(artifact, PROFILE, budget, CONTEXT)
    assert set(chosen.layers) == {"resident"} and chosen.tables_on_host
    assert chosen.gpu_total <= budget and chosen.host_bytes == tables
    assert 0 < chosen.link_bytes_per_token < tables  # one token's rows, not the tables



def test_a_resident_step_is_priced_fused_wherever_its_tables_are(artifact):
    """graph.wanted fuses a step whose every layer is on the GPU, its tables there or in host
    memory (the rows gathered outside the graph): both maps are priced at the fused latency."""
    fused = whole(artifact)
    budget = fused.gpu_total - fused.gpu_bytes["tables"] + 1
    hosted = plan_engine(artifact, PROFILE, budget, CONTEXT)
    assert hosted.tables_on_host and set(hosted.layers) == {"resident"}
    assert hosted.empty_tok_s == pytest.approx(fused.empty_tok_s, rel=1e-6)


def test_a_step_with_streamed_layers_is_priced_unfused(artifact):
    """A streamed layer's copies run on their own stream and the step is captured without fusion:
    each layer pays ENGINE_UNFUSED_FACTOR times the fused latency (222 µs against 60 on an H100).
    With the link and the GPU's memory made free, the step is those latencies alone."""
    from dataclasses import replace

    from gemmactl.plan.engine_map import ENGINE_UNFUSED_FACTOR

    free = replace(PROFILE, gpu_bandwidth=1e30, host_to_device=1e30)
    fused = plan_engine(artifact, free, 64 << 30, CONTEXT)
    budget = fused.gpu_total - fused.gpu_bytes["tables"] - 1
    streamed = plan_engine(artifact, free, budget, CONTEXT)
    assert "streamed" in streamed.layers and "host" not in streamed.layers
    n = len(fused.layers)
    assert 1 / fused.empty_tok_s == pytest.approx(n * PROFILE.gpu_layer_latency_s, rel=1e-6)
    assert 1 / streamed.empty_tok_s == pytest.approx(n * PROFILE.gpu_layer_latency_s * ENGINE_UNFUSED_FACTOR,
                                                     rel=1e-6)
    # latencies off (as other tests set them) stay off
    off = replace(free, gpu_layer_latency_s=0.0)
    assert 1 / plan_engine(artifact, off, budget, CONTEXT).empty_tok_s == pytest.approx(0.0, abs=1e-9)


def test_a_tight_budget_streams_or_hosts_the_rest_and_stays_within_it(artifact):
    from gemmactl.runtime.engine.spec import model_spec

    minimum = whole(artifact).minimum_vram_bytes
    chosen = plan_engine(artifact, PROFILE, minimum, CONTEXT)
    assert "resident" not in chosen.layers and chosen.gpu_total <= minimum
    assert chosen.gpu_bytes["staging"] > 0 and chosen.link_bytes_per_token > 0
    # A layer whose KV cache other layers read never goes to the CPU.
    from gemmactl.formats.int4.reader import read_index

    index = read_index(artifact)
    spec = model_spec(index["config"], {r["name"]: tuple(r.get("stack_shape") or r["shape"]) for r in index["tensors"]})
    producers = {layer.kv_from for layer in spec.layers if not layer.owns_kv}
    assert producers and all(chosen.layers[i] == "streamed" for i in producers)


def test_more_memory_never_predicts_a_slower_decode(artifact):
    minimum, top = whole(artifact).minimum_vram_bytes, whole(artifact).gpu_total
    previous = None
    for budget in range(minimum, top + 1, max((top - minimum) // 8, 1)):
        chosen = plan_engine(artifact, PROFILE, budget, CONTEXT)
        assert chosen.gpu_total <= budget
        if previous is not None:
            assert chosen.layers.count("resident") >= previous.layers.count("resident")
            assert chosen.decode_tok_s >= previous.decode_tok_s
        previous = chosen


def test_resident_layers_are_spread_and_their_compute_hides_under_the_copies(artifact):
    """On a slow link, half the layers resident are spread between the streamed ones (a copy
    overlaps the compute of the layers before it only up to two staging areas ahead), and the
    prediction counts the copies beside the GPU's compute, not after it: what is not the copies
    is the same whether none or half the layers are resident."""
    from dataclasses import replace

    slow = replace(PROFILE, host_to_device=PROFILE.host_to_device / 1000, cpu_op_latency_s=1.0)  # no layer on the CPU
    low, top = whole(artifact).minimum_vram_bytes, whole(artifact).gpu_total
    rows = plan_engine(artifact, slow, top - whole(artifact).gpu_bytes["tables"], CONTEXT).link_bytes_per_token
    none = plan_engine(artifact, slow, low, CONTEXT)
    assert set(none.layers) == {"streamed"}
    budget = low
    while (half := plan_engine(artifact, slow, budget, CONTEXT)).layers.count("resident") < len(half.layers) // 2:
        budget += 64 << 10
    kinds = "".join(kind[0] for kind in half.layers)
    assert "h" not in kinds and "rr" + "r" * (len(kinds) // 4) not in kinds  # no long run of resident layers
    assert kinds.index("s") < kinds.rindex("r")  # not the lower layers alone

    def beside_the_copies(chosen):
        return 1 / chosen.decode_tok_s - (chosen.link_bytes_per_token - rows) / slow.host_to_device

    assert beside_the_copies(half) == pytest.approx(beside_the_copies(none), rel=1e-6)


def test_the_cpu_runs_layers_beside_the_link_when_its_kernels_keep_up(artifact):
    """Layers that do not fit are split between the link and the CPU, which work side by side:
    with a CPU whose kernels read about as fast as the link copies, some go to the CPU, spread
    among the streamed ones, and the step beats streaming them all; with a slow CPU none do. Only
    a layer whose KV cache is its own and no other layer's goes there."""
    from dataclasses import replace

    from gemmactl.formats.int4.reader import read_index
    from gemmactl.runtime.engine.spec import model_spec

    minimum = whole(artifact).minimum_vram_bytes
    # Latencies off and a slow link, so a tiny model's bytes decide as a real model's do.
    base = replace(PROFILE, host_to_device=PROFILE.host_to_device / 1000, cpu_op_latency_s=1e-15,
                   gpu_layer_latency_s=0.0)
    slow = plan_engine(artifact, replace(base, cpu_kernel_bandwidth=base.host_to_device / 100), minimum, CONTEXT)
    assert "host" not in slow.layers
    paired = plan_engine(artifact, replace(base, cpu_kernel_bandwidth=base.host_to_device), minimum, CONTEXT)
    assert "host" in paired.layers and "streamed" in paired.layers and paired.captured
    assert paired.decode_tok_s > slow.decode_tok_s
    assert paired.gpu_total <= minimum and paired.link_bytes_per_token < slow.link_bytes_per_token
    index = read_index(artifact)
    spec = model_spec(index["config"], {r["name"]: tuple(r.get("stack_shape") or r["shape"]) for r in index["tensors"]})
    read_by_others = {layer.kv_from for layer in spec.layers if not layer.owns_kv}
    for layer in spec.layers:
        if paired.layers[layer.index] == "host":
            assert layer.owns_kv and layer.index not in read_by_others


def test_the_schedule_overlaps_the_copies_with_the_cpus_layers():
    """_schedule_seconds plays the engine's step out: a streamed layer's copy crosses while the
    CPU runs the layer before it, so alternating host and streamed layers take about the CPU's
    time plus the first copy, not the sum."""
    from gemmactl.plan.engine_map import HOST_CROSSING_S, LayerCost, _schedule_seconds

    costs = [LayerCost(i, 100, 100, 0, False) for i in range(4)]
    one = lambda c: c.device_bytes / 100  # noqa: E731 - one second a layer, to copy or on the CPU
    none = lambda c: 0.0  # noqa: E731 - the GPU's compute, free here

    def kinds(text):
        return {i: {"s": "streamed", "h": "host", "r": "resident"}[k] for i, k in enumerate(text)}

    assert _schedule_seconds(costs, kinds("ssss"), none, one, one) == pytest.approx(4.0)  # the link alone
    assert _schedule_seconds(costs, kinds("hhhh"), none, one, one) == pytest.approx(4.0 + 2 * HOST_CROSSING_S)
    assert _schedule_seconds(costs, kinds("shsh"), none, one, one) == pytest.approx(3.0 + 4 * HOST_CROSSING_S)
    # Copies cross while the GPU computes: with a second a layer there, they are hidden whole.
    assert _schedule_seconds(costs, kinds("rsrs"), one, one, one) == pytest.approx(4.0)


def test_the_predicted_rate_counts_the_reads_of_the_kv_caches(artifact):
    """Each step reads every attention layer's cache (a sliding layer's window at most, a sharing
    layer its producer's): all of it in a captured step, as far as it is filled in an eager one."""
    from gemmactl.formats.int4.reader import read_index
    from gemmactl.plan.engine_map import cpu_decode_tok_s
    from gemmactl.runtime.engine.kv_modes import pair_bytes
    from gemmactl.runtime.engine.spec import model_spec

    index = read_index(artifact)
    spec = model_spec(index["config"], {r["name"]: tuple(r.get("stack_shape") or r["shape"]) for r in index["tensors"]})
    assert 0 < spec.window < CONTEXT  # both kinds of cache, so the caps differ
    owner = {layer.index: layer for layer in spec.layers}

    def read_bytes(position, mode="bf16"):
        total = 0
        for layer in spec.layers:
            source = owner[layer.kv_from]
            slots = min(position, spec.window if source.kind == "sliding_attention" else CONTEXT)
            total += slots * source.kv_heads * pair_bytes(mode, source.head_dim)
        return total

    assert pair_bytes("bf16", 256) == 2 * 256 * 2  # a key and a value in bfloat16
    # Captured (every layer on the GPU): the whole cache at every position; a quantized cache in
    # fewer bytes, and the weights' part the same, so the two rates differ by the reads alone.
    wide, small = (plan_engine(artifact, PROFILE, 64 << 30, CONTEXT, mode) for mode in ("bf16", "tq4"))
    assert wide.captured and wide.decode_tok_s_at(0) == wide.decode_tok_s_at(CONTEXT) == wide.decode_tok_s
    assert 1 / wide.decode_tok_s - 1 / small.decode_tok_s == pytest.approx(
        (read_bytes(CONTEXT) - read_bytes(CONTEXT, "tq4")) / PROFILE.gpu_bandwidth, rel=1e-6)
    assert wide.to_dict()["decode_tok_s_start"] == wide.to_dict()["decode_tok_s"]
    # Eager (every layer on the CPU): what is written so far, at the CPU's bandwidth.
    start = cpu_decode_tok_s(artifact, PROFILE, CONTEXT)
    for position in (1, spec.window, CONTEXT // 2, CONTEXT, 10 * CONTEXT):
        rate = cpu_decode_tok_s(artifact, PROFILE, CONTEXT, position=position)
        assert 1 / rate - 1 / start == pytest.approx(read_bytes(position) / PROFILE.cpu_bandwidth, rel=1e-6)
    assert cpu_decode_tok_s(artifact, PROFILE, CONTEXT, position=10 * CONTEXT) == \
        cpu_decode_tok_s(artifact, PROFILE, CONTEXT, position=CONTEXT)  # no cache holds more


def test_below_the_minimum_the_error_names_it(artifact):
    minimum = whole(artifact).minimum_vram_bytes
    with pytest.raises(BudgetTooSmallError) as caught:
        plan_engine(artifact, PROFILE, minimum - 1, CONTEXT)
    from gemmactl.sizes import format_size

    assert format_size(minimum) in caught.value.message


def test_the_planned_placement_decodes_what_the_resident_one_does(artifact):
    from gemmactl.formats.int4.reader import open_artifact
    from gemmactl.runtime.engine.model import GemmaModel
    from gemmactl.runtime.engine.placement import EnginePlacement
    from test_engine import PROMPT, engine_greedy

    chosen = plan_engine(artifact, PROFILE, whole(artifact).minimum_vram_bytes, CONTEXT)
    opened = open_artifact(artifact)
    placed = GemmaModel(opened, device="cpu", dtype=torch.float32, context=64,
                        placement=EnginePlacement(chosen.layers, chosen.tables_on_host, chosen.reason))
    resident = GemmaModel(opened, device="cpu", dtype=torch.float32, context=64)
    assert engine_greedy(placed, PROMPT, 16, chunk=5)[0] == engine_greedy(resident, PROMPT, 16, chunk=5)[0]


def test_plan_backend_int4_shows_the_engine_map(artifact, runner):
    result = invoke(runner, ["plan", str(artifact), "--backend", "int4", "--hardware", "desktop-4g", "--json",
                             "--context", str(CONTEXT)])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    engine = data["engine"]
    assert engine["counts"] == {"resident": data["model"]["layers"], "streamed": 0, "host": 0}
    assert engine["gpu_bytes"]["total"] <= data["budget"]["vram_bytes"]
    assert any("the engine follows the 'engine' map" in note for note in data["notes"])

    budget = str(whole(artifact).minimum_vram_bytes)
    text = invoke(runner, ["plan", str(artifact), "--backend", "int4", "--hardware", "desktop-4g", "--vram",
                           budget + "B", "--context", str(CONTEXT)])
    assert text.exit_code == 0, text.output
    assert "engine: 0 layers on the GPU" in text.output and "streamed" in text.output


@pytest.mark.parametrize("below_llamacpp_too", [False, True])
def test_plan_backend_int4_under_the_minimum_is_one_line(artifact, runner, below_llamacpp_too):
    """Under the engine's least budget the error names the engine's, even where llama.cpp's view of
    the model (a smaller least budget: no CUDA context, no staging) would refuse first."""
    from gemmactl.sizes import format_size

    minimum = whole(artifact).minimum_vram_bytes
    short = "1M" if below_llamacpp_too else f"{minimum - 1}B"
    result = invoke(runner, ["plan", str(artifact), "--backend", "int4", "--hardware", "desktop-4g",
                             "--vram", short, "--context", str(CONTEXT)])
    assert result.exit_code != 0
    assert "the engine needs at least" in result.output and "Traceback" not in result.output
    assert format_size(minimum) in result.output


def test_plan_backend_int4_on_a_checkpoint_says_to_quantize_first(tiny_gemma4, runner):
    result = invoke(runner, ["plan", str(tiny_gemma4("dense-ple")), "--backend", "int4", "--hardware", "desktop-4g",
                             "--quant", "int4-g32", "--context", str(CONTEXT), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert "engine" not in data
    assert any("--int4-stream" in note for note in data["notes"])


@pytest.fixture(scope="module")
def moe_artifact(tmp_path_factory):
    return _quantized(tmp_path_factory, "moe")


def test_moe_experts_get_the_room_the_layers_leave(moe_artifact, runner):
    """Experts are not layer weights: they stay in host memory, and the cache takes whole experts
    of the room left after the layers, inside the budget; fewer with less room, none at the
    minimum, where the predicted rate is lower and misses cross the link."""
    from gemmactl.formats.int4.reader import read_index

    everything = plan_engine(moe_artifact, PROFILE, 64 << 30, CONTEXT)
    index = read_index(moe_artifact)
    experts = {(r["layer"], r["expert"]) for r in index["tensors"] if r.get("expert") is not None}
    assert everything.experts == len(experts) == 96 and set(everything.layers) == {"resident"}
    assert everything.tables_on_host  # their room goes to experts, even where both would fit
    assert everything.expert_cache_bytes == 96 * everything.expert_bytes  # room for all
    assert everything.host_bytes >= sum(r["nbytes"] for r in index["tensors"] if r.get("expert") is not None)
    tight = everything.gpu_total - 10 * everything.expert_bytes - 1  # ten experts less than everything
    some = plan_engine(moe_artifact, PROFILE, tight, CONTEXT)
    assert set(some.layers) == {"resident"} and some.gpu_total <= tight
    assert some.expert_cache_bytes == (96 - 11) * everything.expert_bytes
    least = plan_engine(moe_artifact, PROFILE, everything.minimum_vram_bytes, CONTEXT)
    assert least.expert_cache_bytes == 0 and least.gpu_total <= everything.minimum_vram_bytes
    assert least.decode_tok_s < some.decode_tok_s < everything.decode_tok_s
    assert least.link_bytes_per_token > some.link_bytes_per_token
    result = invoke(runner, ["plan", str(moe_artifact), "--backend", "int4", "--hardware", "desktop-4g", "--vram",
                             f"{tight}B", "--context", str(CONTEXT)])
    assert result.exit_code == 0, result.output
    assert f"experts: {96 - 11} of 96 cached on the GPU" in result.output


def test_the_plan_homes_experts_on_the_cpu_only_where_the_link_is_slow(moe_artifact, monkeypatch):
    """expert_split prices each share of a layer's experts computed on the CPU: at the 26B-A4B
    shape none where the link is about as fast as the host's kernels (an H100 machine's 55 GB/s;
    the desktop-4g profile's PCIe 3.0, where homing would gain less than SHARE_GAIN), most where
    the link is a PCIe x4 one (a predicted gain of more than SHARE_GAIN); none without a GPU of its
    own. The map carries its share to the placement, and the engine takes it from there (on the
    tiny model the split is made to say half: its experts are a few KB, priced far below the
    host's fixed costs)."""
    from dataclasses import replace

    from gemmactl.formats.int4.reader import open_artifact
    from gemmactl.plan import engine_map
    from gemmactl.plan.auto import placement_of
    from gemmactl.plan.engine_map import SHARE_GAIN, expert_split
    from gemmactl.runtime.engine.expert_settings import ExpertSettings
    from gemmactl.runtime.engine.model import GemmaModel

    shape = dict(count=3840, layers=30, top_k=8, room=315, one=3345408, stored=3345408, dense=11894784)

    def split(**profile):
        return expert_split(*shape.values(), replace(PROFILE, **profile))

    assert split(host_to_device=55e9, cpu_kernel_bandwidth=67e9)[0] == 0.0
    assert split()[0] == 0.0  # desktop-4g as shipped
    share, seconds, link, slots = split(host_to_device=6e9)  # a PCIe 4.0 x4 link
    none = split(host_to_device=6e9, unified_memory=True)  # one memory: nothing to home
    assert none[0] == 0.0 and share > 0.5 and seconds * SHARE_GAIN <= none[1]
    assert link < none[2] and slots <= shape["count"] * (1 - share)
    assert split(host_to_device=6e9, vram_bytes=0)[0] == 0.0

    def half(count, layers, top_k, room, *rest):
        return 0.5, 1e-3, 0.0, min(room, count // 2)

    monkeypatch.setattr(engine_map, "expert_split", half)
    chosen = plan_engine(moe_artifact, PROFILE, 64 << 30, CONTEXT)
    assert chosen.expert_cpu_share == 0.5 and chosen.to_dict()["experts"]["cpu_share"] == 0.5
    assert "50% of each MoE layer's computed on the CPU" in chosen.reason
    placement = placement_of(chosen, PROFILE)
    assert placement.expert_cpu_share == 0.5 and placement.expert_cache_bytes == chosen.expert_room_bytes
    assert chosen.expert_room_bytes == 96 * chosen.expert_bytes > chosen.expert_cache_bytes
    art = open_artifact(moe_artifact)
    engine = GemmaModel(art, device="cpu", dtype=torch.float32, context=64, placement=placement)
    store = engine.experts.store
    layers = {layer for layer, _ in store.records}
    assert len(store.homed) == len(store.records) // 2 and {layer for layer, _ in store.homed} == layers
    room = placement.expert_cache_bytes // store.expert_bytes  # in this device's expert size
    assert engine.experts.cache.capacity == min(48, room)  # at most every expert not homed
    # Asked for none homed, the cache takes the room the plan's homed experts left.
    unhomed = GemmaModel(art, device="cpu", dtype=torch.float32, context=64, placement=placement,
                         experts=ExpertSettings(cpu_share=0.0))
    assert not unhomed.experts.store.homed and unhomed.experts.cache.capacity == min(96, room)


def test_moe_under_the_plans_placement_decodes_the_same_tokens(moe_artifact):
    """The plan's map at its minimum (every layer streamed, no expert cached) and with some experts
    cached: the engine's greedy tokens are those of every layer and expert resident."""
    from gemmactl.formats.int4.reader import open_artifact
    from gemmactl.runtime.engine.model import GemmaModel
    from gemmactl.runtime.engine.placement import EnginePlacement
    from test_engine import PROMPT, engine_greedy

    art = open_artifact(moe_artifact)
    expected = engine_greedy(GemmaModel(art, device="cpu", dtype=torch.float32, context=CONTEXT), PROMPT, 16)[0]
    everything = plan_engine(moe_artifact, PROFILE, 64 << 30, CONTEXT)
    for budget in (everything.minimum_vram_bytes, everything.gpu_total - 40 * everything.expert_bytes):
        chosen = plan_engine(moe_artifact, PROFILE, budget, CONTEXT)
        placement = EnginePlacement(chosen.layers, chosen.tables_on_host, chosen.reason, chosen.expert_cache_bytes)
        engine = GemmaModel(art, device="cpu", dtype=torch.float32, context=CONTEXT, placement=placement)
        assert engine_greedy(engine, PROMPT, 16, chunk=5)[0] == expected
        cached = engine.experts.cache.capacity  # the plan's room, in this device's expert size
        assert (cached > 0) == (chosen.expert_cache_bytes > 0)


@pytest.fixture
def small_work(monkeypatch):
    """The prefill's attention scores and a quantized cache's read (a block of slots, scores and
    sums for a prefill chunk; the fused read's scores of every slot, for one row) held to small
    bounds: in a model this tiny they would outweigh its KV caches."""
    from gemmactl.plan import engine_map
    from gemmactl.runtime.engine import kv_modes
    from gemmactl.runtime.engine import spec as spec_module

    monkeypatch.setattr(spec_module, "SCORES_BLOCK_BYTES", 256 << 10)
    monkeypatch.setattr(kv_modes, "READ_BLOCK_BYTES", 16 << 10)
    monkeypatch.setattr(kv_modes, "FUSED_ROWS_MAX", 1)
    monkeypatch.setattr(engine_map, "CHUNK_TOKENS", 16)


def test_the_kv_mode_sizes_the_caches_and_context_max_finds_the_longest(artifact, runner, small_work):
    """tq4 keeps about a quarter of bf16's KV bytes, so at the budget where bf16 reaches 1024 tokens
    tq4 reaches more than 3 times as many; `plan --context max` says so. (Here a slot of tq4 is
    3.47 times smaller than bf16's, with 64-wide heads and each slot's 8-byte position, and the
    read's fixed room takes a few hundred slots; E4B shapes: docs/benchmarks.md.)
    The prefill's attention scores, which also grow with the context until their block bound,
    and a quantized cache's read (a block of slots, scores and sums for a prefill chunk) are held
    to small bounds here: in a model this tiny they would outweigh its KV caches."""
    from gemmactl.plan.engine_map import _index_and_spec, _read_bytes, _work_bytes, longest_context

    _, spec = _index_and_spec(artifact)
    reads = {n: _read_bytes(spec, n, "tq4", 0) for n in (16, 4096)}
    assert 0 < reads[16] <= reads[4096]  # a read block's room: the whole cache up to a block, then one block
    # A quantized read's scores are its block's (in its room), never the context's; bf16's are the context's.
    assert _work_bytes(spec, 4096, "tq4") - reads[4096] == _work_bytes(spec, 16, "tq4") - reads[16] \
        < _work_bytes(spec, 4096, "bf16")

    modes = ("bf16", "int8", "tq4", "tq3", "tq4/bf16", "bf16/tq4")
    kv = {mode: plan_engine(artifact, PROFILE, 64 << 30, 4096, mode).gpu_bytes["kv"] for mode in modes}
    assert kv["bf16"] > kv["int8"] > kv["tq4"] > kv["tq3"] > 0
    # GLOBAL/WINDOWS: each layer's cache in its kind's mode, so the two mixes add up to the plain modes
    assert kv["tq4"] < kv["tq4/bf16"] < kv["bf16"] and kv["tq4"] < kv["bf16/tq4"] < kv["bf16"]
    assert kv["tq4/bf16"] + kv["bf16/tq4"] == kv["tq4"] + kv["bf16"]
    budget = plan_engine(artifact, PROFILE, 64 << 30, 1024).minimum_vram_bytes
    longest = {mode: longest_context(artifact, PROFILE, budget, mode) for mode in ("bf16", "tq4")}
    assert longest["bf16"] == 1024 and longest["tq4"] >= 3 * longest["bf16"]
    result = invoke(runner, ["plan", str(artifact), "--backend", "int4", "--hardware", "desktop-4g", "--vram",
                             f"{budget}B", "--context", "max", "--kv-cache", "tq4", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["context"] == longest["tq4"] and data["engine"]["kv_cache"] == "tq4"
    result = invoke(runner, ["plan", str(artifact), "--backend", "int4", "--hardware", "desktop-4g", "--vram",
                             f"{budget}B", "--context", "4096"])
    assert result.exit_code != 0 and "the longest context that fits is 1024" in result.output
    assert "--context 1024 or less" in result.output and "Traceback" not in result.output
    for args, message in ((["--backend", "llamacpp", "--context", "max"], "int4 engine's plan for its longest context"),
                          (["--backend", "int4", "--kv-cache", "q4_0"], "not a KV cache mode of the int4 engine"),
                          (["--backend", "int4", "--context", "lots"], "neither a number of tokens nor max")):
        result = invoke(runner, ["plan", str(artifact), "--hardware", "desktop-4g", *args])
        assert result.exit_code != 0 and message in result.output and "Traceback" not in result.output, result.output


def test_context_max_also_names_the_longest_context_keeping_every_layer_on_the_gpu(artifact, runner, small_work):
    """Past the longest context at which every layer stays on the GPU the engine streams layers
    for the cache's room (and still runs, to longest_context); `plan --context max` names both."""
    from gemmactl.formats.int4.reader import read_index
    from gemmactl.plan.engine_map import longest_context, longest_resident_context
    from gemmactl.runtime.engine.spec import hf_text_config

    def resident(context: int, mode: str, budget: int) -> bool:
        try:
            return all(kind == "resident" for kind in plan_engine(artifact, PROFILE, budget, context, mode).layers)
        except BudgetTooSmallError:
            return False

    whole = plan_engine(artifact, PROFILE, 64 << 30, 1024)
    budget = whole.gpu_total - whole.gpu_bytes["tables"] + (96 << 10)  # every layer at 1024, the tables in host memory
    found = {mode: longest_resident_context(artifact, PROFILE, budget, mode) for mode in ("bf16", "tq4")}
    limit = int(hf_text_config(read_index(artifact)["config"]).max_position_embeddings)
    for mode, n in found.items():
        assert resident(n, mode, budget) and (n == limit or not resident(n + 256, mode, budget))
        assert longest_context(artifact, PROFILE, budget, mode) >= n  # longer where streaming frees room
    assert found["bf16"] >= 1024 and found["tq4"] > 2 * found["bf16"]
    assert longest_resident_context(artifact, PROFILE, plan_engine(artifact, PROFILE, 64 << 30, 256).minimum_vram_bytes) == 0
    result = invoke(runner, ["plan", str(artifact), "--backend", "int4", "--hardware", "desktop-4g", "--vram",
                             f"{budget}B", "--context", "max", "--kv-cache", "tq4"])
    assert result.exit_code == 0, result.output
    assert "every layer on the GPU up to " in result.output


@pytest.fixture(scope="module")
def runnable_artifact(tiny_checkpoint, tmp_path_factory):
    """The same arrangement with the real Gemma 4 tokenizer beside it, so the engine can answer."""
    folder = tmp_path_factory.mktemp("engine-map-runnable")
    quantize_checkpoint(tiny_checkpoint("e2b-tiny"), folder / "artifact", QuantizeOptions(group_size=32, shard_size=1 << 30))
    return folder / "artifact"


def test_plan_verify_runs_the_engine_with_its_map(runnable_artifact, runner):
    """`plan --backend int4 --verify` decodes with the engine (on the CPU here, every layer there,
    the prediction re-made for this machine) and reports measured against predicted."""
    artifact = runnable_artifact
    result = invoke(runner, ["plan", str(artifact), "--backend", "int4", "--hardware", "desktop-4g", "--verify",
                             "--json", "--context", str(CONTEXT)])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    verify = data["verify"]
    assert verify["placement"].startswith("cpu") and verify["n_gpu_layers"] == 0
    assert verify["engine_layers"] == {"resident": 0, "streamed": 0, "host": data["model"]["layers"]}
    assert verify["decode_tokens"] >= 1 and verify["measured_decode_tok_s"] > 0
    # The prediction is the engine's all-CPU cost, not the desktop-4g map's GPU rate.
    assert verify["predicted_decode_tok_s"] != round(data["engine"]["decode_tok_s"], 2)
    assert verify["peak_gpu_bytes"] == 0 and verify["within_budget"]
    text = invoke(runner, ["plan", str(artifact), "--backend", "int4", "--hardware", "desktop-4g", "--verify",
                           "--context", str(CONTEXT)])
    assert text.exit_code == 0, text.output
    assert "verify: measured decode" in text.stdout and "the engine ran every layer on the CPU" in text.stdout


def test_plan_verify_for_the_engine_needs_an_artifact(tiny_gemma4, runner):
    result = invoke(runner, ["plan", str(tiny_gemma4("dense-ple")), "--backend", "int4", "--hardware", "desktop-4g",
                             "--quant", "int4-g32", "--context", str(CONTEXT), "--verify"])
    assert result.exit_code != 0
    assert "int4-stream" in result.output and "Traceback" not in result.output
    assert len([line for line in result.stderr.splitlines() if line.strip()]) <= 2


@pytest.mark.parametrize("spare", [0, 3, 8])
def test_the_map_sizes_the_rings_the_engine_allocates_for_a_draft(artifact, spare):
    """Speculation keeps `spare` ring slots past each sliding layer's window; the map's KV bytes are
    the ones the engine allocates with them (bfloat16 caches, as on a GPU)."""
    from gemmactl.formats.int4.reader import open_artifact
    from gemmactl.runtime.engine.model import GemmaModel

    planned = plan_engine(artifact, PROFILE, 64 << 30, CONTEXT, spare_slots=spare).gpu_bytes["kv"]
    model = GemmaModel(open_artifact(artifact), device="cpu", dtype=torch.bfloat16, context=CONTEXT,
                       spare_slots=spare)
    assert model.memory()["kv_device_bytes"] == planned


def test_plan_keeps_room_for_a_draft(artifact, runner):
    """`plan --draft`: the draft's own every-layer-resident map (less the CUDA context the model's
    map already reserves, and the tables the draft keeps in host memory) comes off the budget, the least that works grows by it, and the model's
    rings keep --draft-max spare slots; without room, the error names the draft."""
    from gemmactl.plan.engine_map import DraftNeed, draft_gpu_bytes

    def plan(*extra):
        result = invoke(runner, ["plan", str(artifact), "--backend", "int4", "--hardware", "desktop-4g", "--json",
                                 "--context", str(CONTEXT), *extra])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)["engine"]

    alone, beside = plan(), plan("--draft", str(artifact), "--draft-max", "6")
    alone_draft = plan_engine(artifact, PROFILE, 64 << 30, CONTEXT, spare_slots=6)
    draft_bytes = alone_draft.gpu_total - alone_draft.gpu_bytes["reserve"] - alone_draft.gpu_bytes["tables"]
    assert alone_draft.gpu_bytes["tables"] > 0
    assert beside["gpu_bytes"]["draft"] == draft_bytes == draft_gpu_bytes(DraftNeed(artifact, 6), PROFILE, CONTEXT)
    assert beside["gpu_bytes"]["kv"] == alone_draft.gpu_bytes["kv"] > alone["gpu_bytes"]["kv"]
    assert beside["minimum_vram_bytes"] == alone["minimum_vram_bytes"] + draft_bytes + (
        beside["gpu_bytes"]["kv"] - alone["gpu_bytes"]["kv"])

    short = f"{beside['minimum_vram_bytes'] - 1}B"
    result = invoke(runner, ["plan", str(artifact), "--backend", "int4", "--hardware", "desktop-4g", "--vram", short,
                             "--context", str(CONTEXT), "--draft", str(artifact), "--draft-max", "6"])
    assert result.exit_code != 0 and "the draft's" in result.output and "leave out the draft" in result.output
    assert "Traceback" not in result.output


def test_a_draft_that_costs_the_model_its_room_says_so(artifact, runner):
    """Under a budget where the draft's room moves the model's layers off the GPU, the map's reason
    gives both predictions and the speed-up speculation would need; with room for both, nothing."""
    from gemmactl.plan.auto import with_draft_cost
    from gemmactl.plan.engine_map import DraftNeed

    need = DraftNeed(artifact, 4)
    roomy = plan_engine(artifact, PROFILE, 64 << 30, CONTEXT, draft=need)
    assert with_draft_cost(roomy, whole(artifact)) is roomy
    # the least that holds the draft beside the model, and half the model's layers: the rest stream
    tight = roomy.minimum_vram_bytes + whole(artifact).gpu_bytes["layers"] // 2
    beside = plan_engine(artifact, PROFILE, tight, CONTEXT, draft=need)
    alone = plan_engine(artifact, PROFILE, tight, CONTEXT)
    assert alone.decode_tok_s > 1.05 * beside.decode_tok_s
    reason = with_draft_cost(beside, alone).reason
    assert reason.startswith(beside.reason) and f"{alone.decode_tok_s:.1f} alone" in reason
    assert f"speculation must give {alone.decode_tok_s / beside.decode_tok_s:.1f}× to pay" in reason

    result = invoke(runner, ["plan", str(artifact), "--backend", "int4", "--hardware", "desktop-4g", "--json",
                             "--context", str(CONTEXT), "--vram", f"{tight}B", "--draft", str(artifact)])
    assert result.exit_code == 0, result.output
    assert "the draft's room costs the model" in json.loads(result.stdout)["engine"]["reason"]


def test_a_draft_that_does_not_fit_beside_the_model_is_dropped_with_a_reason(artifact, monkeypatch, tmp_path):
    """On a GPU whose budget holds the model's least map but not the draft beside it, the tier runs
    without speculation and its draft carries why; with room, the draft stays and the map keeps it."""
    import gemmactl.plan.auto as auto
    from gemmactl.generate import _engine_placement_with_draft
    from gemmactl.machine import Gpu, Machine
    from gemmactl.runtime.engine.draft import DraftSettings
    from gemmactl.store import Store
    from gemmactl.store.refs import resolve_model

    machine = Machine("test cpu", 2, [], 32 << 30, "x86_64", gpus=[Gpu(0, "Fake 4 GB", 4096 * MiB, "1", "7.5")])
    monkeypatch.setattr(auto, "detect_machine", lambda: machine)
    monkeypatch.setattr("gemmactl.plan.profile.gpu_free_bytes", lambda index=0: 4096 * MiB)
    monkeypatch.setattr("gemmactl.plan.profile.cached_profile", lambda *a, **k: PROFILE)
    store = Store(tmp_path / "home")
    model = resolve_model(str(artifact), store)
    draft = DraftSettings(str(artifact), k_max=4)
    alone = whole(artifact).minimum_vram_bytes
    placement, kept = _engine_placement_with_draft(model, CONTEXT, alone, store, None, draft)
    assert placement is not None and kept.problem.startswith("it does not fit beside the model in the GPU budget")
    placement, kept = _engine_placement_with_draft(model, CONTEXT, 4096 * MiB, store, None, draft)
    assert kept == draft and set(placement.layers) == {"resident"}


@pytest.mark.parametrize("setting, expected", [("rows", 1000 * 64 + 1000 * 2), ("dense", 1000 * 64 * 2)])
def test_a_plan_for_a_gpu_elsewhere_counts_int8_rows_as_its_cuda_install_holds_them(monkeypatch, setting, expected):
    """Planned on a machine without CUDA (and without Triton, as here and in CI), the target's head
    of int8 rows counts as int8, as torch's CUDA install (which ships Triton) holds it there."""
    from gemmactl.runtime.engine import int8_gemv, kernels

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(int8_gemv, "available", lambda device: False)
    monkeypatch.setenv(kernels.INT8_ENV, setting)
    assert kernels.linear_bytes("int8", (1000, 64), None, cuda=True) == expected


def test_the_profile_measures_the_cpu_kernels_and_falls_back_to_the_copy_rate():
    from dataclasses import replace

    from gemmactl.plan.profile import _cpu_kernel_bandwidth
    from gemmactl.runtime.engine.cpu_kernels import cpu_kernels_kept

    rate = _cpu_kernel_bandwidth(repeats=2)
    assert rate > 0 if cpu_kernels_kept(torch.bfloat16) else rate == 0.0
    assert replace(PROFILE, cpu_kernel_bandwidth=0.0).host_kernel_bandwidth == PROFILE.cpu_bandwidth
    assert PROFILE.host_kernel_bandwidth == PROFILE.cpu_kernel_bandwidth > 0
    from gemmactl.plan.profile import DEFAULT_CPU_OP_S, ENGINE_LAYER_OPS, ENGINE_OPS_PER_MB, _cpu_op_latency

    assert 0 < _cpu_op_latency(repeats=50) < 1e-3
    # A shipped profile prices an operation at the default; a layer's operations grow with its size.
    assert PROFILE.engine_host_layer_s(0) == pytest.approx(ENGINE_LAYER_OPS * DEFAULT_CPU_OP_S)
    e4b_layer = 62_000_000
    assert PROFILE.engine_host_layer_s(e4b_layer) == pytest.approx((ENGINE_LAYER_OPS + 62 * ENGINE_OPS_PER_MB)
                                                                   * DEFAULT_CPU_OP_S)
