"""MoE experts in the engine: the expert cache's policies and counters, and that where an expert
comes from (cached, copied in, computed on the host) never changes a token.

On this machine the host stands in for the GPU (runtime/engine/experts.py): the cache, its
policy and its counters run as they do on a GPU, and copies are memory copies.
"""

from __future__ import annotations

import pytest
import torch

from gemmactl.runtime.engine import experts as experts_module
from gemmactl.runtime.engine.device_copies import COPIES_ENV
from gemmactl.runtime.engine.experts import ExpertCache, ExpertSettings, MissRule
from test_engine import PROMPT, engine_greedy

STEPS = 24


@pytest.fixture(scope="module")
def moe_artifact(tmp_path_factory):
    from gemmactl.formats.int4.layout import QuantizeOptions
    from gemmactl.formats.int4.quantize import quantize_checkpoint
    from gemmactl.formats.int4.reader import open_artifact
    from helpers.random_gemma import build_random_gemma

    folder = tmp_path_factory.mktemp("engine-moe")
    source = build_random_gemma("moe", folder / "checkpoint")
    quantize_checkpoint(source, folder / "artifact", QuantizeOptions(group_size=32, shard_size=1 << 30))
    return open_artifact(folder / "artifact")


def _engine(artifact, settings=None):
    from gemmactl.runtime.engine.model import GemmaModel

    return GemmaModel(artifact, device="cpu", dtype=torch.float32, context=64, experts=settings)


def _decode(engine, experts_of=None) -> tuple[list, torch.Tensor]:
    """Greedy tokens and every decode step's logits, each step's experts summed by experts_of
    (an ExpertCall → the experts' sum; None: the block's own combine)."""
    logits_seen = []

    def decoder(token, position):
        x, per_layer = engine.embed_tokens(token)
        logits = engine.forward(x, per_layer, torch.tensor([position]), position + 1, experts_of=experts_of)
        logits_seen.append(logits.clone())
        return logits

    tokens, _ = engine_greedy(engine, PROMPT, STEPS, chunk=3, decoder=decoder)
    return tokens, torch.stack(logits_seen)


def test_every_cache_size_policy_and_miss_path_gives_the_same_tokens_and_logits(moe_artifact, monkeypatch):
    """Room for every expert, for a few, for none (the cache off), each policy, misses copied in or
    computed on the host, with and without prefetch: token for token and bit for bit what the
    fully cached engine gives.
    Aging runs every few lookups here, so lfu's decay and hot's pinned set change during the run."""
    monkeypatch.setattr(experts_module, "AGE_EVERY", 7)
    reference = _engine(moe_artifact)
    expected_tokens, expected_logits = engine_greedy(reference, PROMPT, STEPS, chunk=3)
    expert_bytes = reference.experts.store.expert_bytes
    total = len(reference.experts.store.records)
    assert reference.experts.cache.capacity == total  # default: room for every expert
    seen_evictions = seen_prefetch_hits = False
    for policy in ("lru", "lfu", "hot"):
        for slots in (0, 3, total // 4):
            for miss, prefetch in (("copy", False), ("copy", True), ("cpu", False)):
                settings = ExpertSettings(cache_bytes=slots * expert_bytes, policy=policy, miss=miss, prefetch=prefetch)
                engine = _engine(moe_artifact, settings)
                tokens, logits = engine_greedy(engine, PROMPT, STEPS, chunk=3)
                label = (policy, slots, miss, prefetch)
                assert tokens == expected_tokens, label
                assert torch.equal(logits, expected_logits), label
                stats = engine.experts.stats()
                assert stats["capacity_experts"] == slots and stats["policy"] == policy
                assert stats["hits"] + stats["misses"] == engine.experts.cache.lookups > 0
                if miss == "cpu" or slots == 0:
                    assert stats["hits"] == 0  # nothing is ever kept
                if miss == "cpu":
                    assert stats["host_share"] == 1.0 and stats["copied"] == 0
                else:
                    assert stats["copied"] == stats["misses"] and stats["host_share"] == 0.0
                    seen_evictions |= 0 < slots < stats["misses"]
                assert (stats["prefetched"] > 0) == (prefetch and slots > 0), label
                seen_prefetch_hits |= stats["prefetch_hits"] > 0
    assert seen_evictions and seen_prefetch_hits


@pytest.mark.parametrize("policy, slots, prefetch", [
    ("lru", 0, False), ("lru", 1, False), ("lru", 3, False), ("lfu", "quarter", False), ("hot", 7, True),
])
def test_experts_copied_from_an_arena_give_the_same_tokens_and_logits(moe_artifact, monkeypatch, policy, slots,
                                                                       prefetch):
    """The arena (every expert laid out in one host buffer, copied row by row into device rows:
    what CUDA runs, here with the host's tensors): the cache off (scratch rows only), one slot
    (the layer's own experts are kept, so most misses go to scratch rows), a few, a quarter;
    token for token and bit for bit what the engine without an arena gives."""
    from gemmactl.runtime.engine.expert_arena import SCRATCH

    from gemmactl.runtime.engine import expert_arena

    monkeypatch.setattr(experts_module, "AGE_EVERY", 7)
    monkeypatch.setattr(expert_arena, "CHUNK_BYTES", 50_000)  # a few rows a chunk: rows cross chunks
    reference = _engine(moe_artifact, ExpertSettings(arena=False))
    expected_tokens, expected_logits = engine_greedy(reference, PROMPT, STEPS, chunk=3)
    store = reference.experts.store
    slots = len(store.records) // 4 if slots == "quarter" else slots
    settings = ExpertSettings(cache_bytes=slots * store.expert_bytes, policy=policy, miss="copy", prefetch=prefetch,
                              arena=True)
    engine = _engine(moe_artifact, settings)
    arena, top_k = engine.experts.store.arena, engine.experts.top_k
    # prefetch's ahead rows (two sets of top_k) come out of the cache's room
    capacity = max(0, slots - 2 * top_k) if prefetch else slots
    assert arena is not None and arena.on_device.shape[0] == capacity + SCRATCH + top_k + (2 * top_k if prefetch else 0)
    assert sum(chunk.shape[0] for chunk in arena.chunks) == len(store.records) and len(arena.chunks) > 1
    tokens, logits = engine_greedy(engine, PROMPT, STEPS, chunk=3)
    assert tokens == expected_tokens
    assert torch.equal(logits, expected_logits)
    stats = engine.experts.stats()
    assert stats["copied"] == stats["misses"] > 0 and stats["host_share"] == 0.0
    assert stats["capacity_experts"] == capacity
    assert stats["hits"] == 0 if capacity == 0 else capacity < len(store.records) // 4 or stats["hits"] > 0
    if slots == 0 and not prefetch:  # every decoded token brings each layer's top-k experts over the link
        layers = len(engine.experts.blocks)
        assert stats["link_bytes_per_decode_token"] == layers * engine.experts.top_k * store.stored_bytes
        assert stats["link_bytes_per_token"] < stats["link_bytes_per_decode_token"]  # a prefill chunk's experts serve its tokens


@pytest.mark.gpu
def test_gpu_experts_from_the_arena_decode_like_without(moe_artifact):
    """On CUDA (bfloat16; the experts as stored, in the Triton kernels, or where Triton is missing in
    tinygemm with their columns padded): the arena's asynchronous copies and their events give the
    tokens of the engine that makes each expert when it misses, with the cache off, small and
    whole; a copy read before it landed would not."""
    from gemmactl.runtime.engine.kernels import int4_groups_kept
    from gemmactl.runtime.engine.model import GemmaModel

    def greedy(settings):
        engine = GemmaModel(moe_artifact, device="cuda", dtype=torch.bfloat16, context=64, experts=settings)
        return engine_greedy(engine, PROMPT, STEPS, chunk=3), engine

    (expected, expected_logits), reference = greedy(ExpertSettings(arena=False))
    assert reference.experts.store.arena is None
    store = reference.experts.store
    kernels = {type(linear).__name__ for linear in store.linears(next(iter(store.records)), torch.device("cuda"))}
    assert kernels == {"Int4GroupsLinear" if int4_groups_kept(expert=True) else "Int4Linear"}  # not dense
    for slots in (0, 3, len(store.records)):
        (tokens, logits), engine = greedy(ExpertSettings(cache_bytes=slots * store.expert_bytes))
        assert engine.experts.store.arena is not None  # the default on CUDA
        assert tokens == expected, slots
        assert (logits.float() - expected_logits.float()).abs().max() <= 1e-2 * expected_logits.float().abs().max()


def _staged_engine(artifact, settings, addressed: bool):
    engine = _engine(artifact, settings)
    engine.experts.store.arena.addressed = addressed  # as graph_moe.PiecewiseDecode sets it at capture
    return engine


@pytest.mark.parametrize("addressed", [True, False], ids=["addressed", "copies"])
@pytest.mark.parametrize("policy, slots", [("lfu", 0), ("lru", 1), ("lfu", 3), ("hot", "quarter")])
def test_a_step_staged_for_capture_gives_the_tokens_logits_and_counts_of_the_eager_one(moe_artifact, monkeypatch,
                                                                                      policy, slots, addressed):
    """What a captured MoE step runs (graph_moe.py), here eagerly with the host's tensors: each
    layer's chosen experts read in their rows, the misses copied into theirs (addressed), or every
    one copied into the arena's staging rows (copies), by stage; summed from there by staged_sum,
    with no host decision in it. Every decode step's logits bit for bit those of combine() on an
    engine with the same cache, and the same hits, misses and copies."""
    monkeypatch.setattr(experts_module, "AGE_EVERY", 7)

    copies = {"made": 0, "misses": 0, "lookups": 0}  # over the staged steps

    def decode(engine, staged: bool):
        arena, cache = engine.experts.store.arena, engine.experts.cache
        move = arena.move

        def counted(moves, *rest):
            copies["made"] += len(moves)
            move(moves, *rest)

        arena.move = counted

        def experts_of(call):
            misses, lookups = cache.misses, cache.lookups
            call.block.stage(call.experts)
            copies["misses"] += cache.misses - misses
            copies["lookups"] += cache.lookups - lookups
            return call.block.staged_sum(call.x, call.weights, call.experts)

        return (*_decode(engine, experts_of if staged else None), engine.experts.stats())

    store = _engine(moe_artifact).experts.store
    room = len(store.records) // 4 if slots == "quarter" else slots
    settings = ExpertSettings(cache_bytes=room * store.expert_bytes, policy=policy, miss="copy", arena=True,
                              prefetch=False)
    runs = [decode(_staged_engine(moe_artifact, settings, addressed), staged) for staged in (False, True)]
    (tokens, logits, stats), (staged_tokens, staged_logits, staged_stats) = runs
    assert staged_tokens == tokens
    assert torch.equal(staged_logits, logits)
    for key in ("hits", "misses", "copied", "capacity_experts"):
        assert staged_stats[key] == stats[key], key
    assert staged_stats["misses"] > 0 and (slots != "quarter" or staged_stats["hits"] > 0)
    # Addressed, a miss is one copy and a hit none; copied, every expert at least one.
    assert copies["made"] == copies["misses"] if addressed else copies["made"] >= copies["lookups"]


@pytest.mark.parametrize("addressed", [True, False], ids=["addressed", "copies"])
@pytest.mark.parametrize("policy, slots", [("lfu", 0), ("lru", 1), ("lfu", "half"), ("hot", "half")])
def test_a_staged_step_with_prefetch_takes_guessed_misses_from_the_ahead_rows_and_changes_nothing_else(
        moe_artifact, monkeypatch, policy, slots, addressed):
    """Prefetch in a captured step (graph_moe.py, here eagerly with the host's tensors): after each
    layer's stage, the next layer's router applied to this layer's residual stream picks experts
    that are copied into the arena's ahead rows, and the next layer's misses among them come from
    there. Logits bit for bit, and hits, misses and copies as staged without prefetch with the
    cache the ahead rows leave; some misses served from the ahead rows, and none of their bytes
    crossing the link twice."""
    monkeypatch.setattr(experts_module, "AGE_EVERY", 7)
    store = _engine(moe_artifact).experts.store
    top_k = _engine(moe_artifact).experts.top_k
    room = len(store.records) // 2 if slots == "half" else slots

    def decode(prefetch: bool):
        cache = room if prefetch else max(0, room - 2 * top_k)  # the ahead rows come out of the cache's room
        engine = _staged_engine(moe_artifact, ExpertSettings(cache_bytes=cache * store.expert_bytes, policy=policy,
                                                             miss="copy", prefetch=prefetch, arena=True), addressed)
        for block in engine.experts.blocks:
            block.prefetch = False  # the prompt's eager steps alike in both (no copies into the cache ahead)
        arena, move = engine.experts.store.arena, engine.experts.store.arena.move
        read_ahead = {"rows": 0, "later": 0, "sets": set()}

        def counted(moves, rows=None, target=None, later=()):
            first, end = arena.ahead, arena.ahead + 2 * arena.ahead_count
            ahead = [row for row in rows or () if first <= row < end]
            read_ahead["rows"] += len(ahead)
            read_ahead["sets"] |= {(row - first) // arena.ahead_count for row in ahead}
            read_ahead["later"] += len(later)
            move(moves, rows, target, later)

        arena.move = counted

        def experts_of(call):
            block = call.block
            guess = block.next.route(call.residual)[1] if prefetch and block.next is not None else None
            # as a captured step reads them: the choice and the guess side by side, at once
            choice = torch.cat((call.experts, guess), dim=1) if guess is not None else None
            guessed = block.stage(call.experts, guess, None, choice)
            if guessed is not None:
                block.next.stage_ahead(guessed)
            return block.staged_sum(call.x, call.weights, call.experts)

        tokens, logits = _decode(engine, experts_of)
        return tokens, logits, {**engine.experts.stats(), "decode_bytes": engine.experts.counters.decode_bytes,
                                **read_ahead}

    (tokens, logits, stats), (ahead_tokens, ahead_logits, ahead_stats) = decode(False), decode(True)
    assert ahead_tokens == tokens
    assert torch.equal(ahead_logits, logits)
    for key in ("hits", "misses", "copied", "capacity_experts"):
        assert ahead_stats[key] == stats[key], key
    assert ahead_stats["capacity_experts"] == max(0, room - 2 * top_k)
    assert 0 < ahead_stats["prefetch_hits"] <= ahead_stats["prefetched"]
    # A decoded miss crosses the link once, ahead or at its layer; a wrong guess crosses for nothing.
    assert ahead_stats["decode_bytes"] == stats["decode_bytes"] + store.stored_bytes * (
        ahead_stats["prefetched"] - ahead_stats["prefetch_hits"])
    # Addressed, a guessed miss is read in its ahead row, and copied on into its slot (if the cache
    # keeps it) after what the next piece waits for; copied, it goes through the staging rows.
    assert ahead_stats["rows"] == (ahead_stats["prefetch_hits"] if addressed else 0)
    assert (ahead_stats["later"] > 0) == (addressed and ahead_stats["capacity_experts"] > 0)
    assert ahead_stats["later"] <= ahead_stats["rows"] and stats["rows"] == stats["later"] == 0
    assert ahead_stats["sets"] == ({0, 1} if addressed else set())  # the two sets of ahead rows in turn


@pytest.mark.parametrize("share", [0.5, 1.0])
def test_experts_homed_on_the_host_give_the_same_tokens_whatever_the_cache_and_staged_or_not(moe_artifact,
                                                                                         monkeypatch, share):
    """A share of each layer's experts homed on the host (ExpertSettings.cpu_share): computed there
    always, never cached or copied, so the cache's size, its policy and prefetch change nothing,
    eagerly or staged as a captured step runs them (the homed experts' outputs taken in place of
    their staging rows). Token for token and bit for bit the engine with the same homes and every
    other expert cached; the cache sees only the other experts, and the arena holds rows for them
    alone."""
    monkeypatch.setattr(experts_module, "AGE_EVERY", 7)
    reference = _engine(moe_artifact, ExpertSettings(cpu_share=share, arena=True, prefetch=False))
    expected_tokens, expected_logits = engine_greedy(reference, PROMPT, STEPS, chunk=3)
    store = reference.experts.store
    layers = {layer for layer, _ in store.records}
    per_layer = len(store.records) // len(layers)
    assert len(store.homed) == len(layers) * round(share * per_layer)
    assert len(store.homed) < len(store.records) or share == 1.0
    total = len(store.records) - len(store.homed)
    assert reference.experts.cache.capacity == total and len(store.arena.rows) == total
    assert not set(store.arena.rows) & store.homed

    def decode(engine, staged: bool, prefetch: bool):
        def experts_of(call):
            block = call.block
            guess = block.next.route(call.residual)[1] if prefetch and block.next is not None else None
            guessed = block.stage(call.experts, guess, call.x)
            if guessed is not None:
                block.next.stage_ahead(guessed)
            return block.staged_sum(call.x, call.weights, call.experts)

        return (*_decode(engine, experts_of if staged else None), engine.experts.stats())

    _, reference_logits, _ = decode(_engine(moe_artifact, ExpertSettings(cpu_share=share, arena=True,
                                                                          prefetch=False)), False, False)
    for policy, slots, prefetch in (("lfu", 0, False), ("lru", 1, False), ("lfu", "half", True),
                                    ("hot", "half", False)):
        room = total // 2 if slots == "half" else slots
        for staged, addressed in ((False, False), (True, True), (True, False)):
            settings = ExpertSettings(cache_bytes=room * store.expert_bytes, policy=policy, cpu_share=share,
                                      arena=True, prefetch=prefetch)
            engine = _staged_engine(moe_artifact, settings, addressed)
            if not staged:
                for block in engine.experts.blocks:
                    block.prefetch = False  # eager prefetch copies into the cache: its hits differ
            tokens, logits, stats = decode(engine, staged, prefetch and staged)
            label = (policy, slots, prefetch, staged, addressed)
            assert tokens == expected_tokens, label
            assert torch.equal(logits, reference_logits), label
            assert stats["hits"] + stats["misses"] == engine.experts.cache.lookups, label
            assert 0 < stats["host_share"] <= 1.0 and (stats["host_share"] == 1.0) == (share == 1.0), label
            if share == 1.0:
                assert stats["hits"] == stats["misses"] == stats["copied"] == 0, label


def test_the_forward_hands_each_moe_layers_experts_to_its_caller(moe_artifact):
    """forward(experts_of=...) is where a captured MoE step cuts its graphs: it is called once per
    MoE layer, in order, with the router's choice made, and what it returns is that layer's sum."""
    engine = _engine(moe_artifact)
    tokens, positions = torch.tensor([2, 5, 7]), torch.arange(3)
    with torch.inference_mode():
        expected = engine.step(tokens, positions, 3)
        engine.reset()
        calls = []

        def experts_of(call):
            calls.append(call)
            return call.run()

        x, per_layer = engine.embed_tokens(tokens)
        logits = engine.forward(x, per_layer, positions, 3, experts_of=experts_of)
    assert torch.equal(logits, expected)
    assert [call.block.layer for call in calls] == [layer.spec.index for layer in engine.layers if layer.moe is not None]
    assert all(call.experts.shape == (3, engine.experts.top_k) for call in calls)


def test_a_whole_steps_record_is_counted_as_its_reads_and_admitted_within_the_budget(moe_artifact, monkeypatch):
    """MoEExperts.keep_record, the host's side of the whole step (graph_moe.TableDecode): a hit
    moves nothing; a miss the step's fetch brought in is a prefetch hit, its bytes counted once
    when fetched (a fetched expert never used counts too); any other miss is read in place and
    counted so. Misses are admitted by the policy, or at most GEMMACTL_ENGINE_TABLE_ADMIT a token,
    the layers taking turns to go first (a value that is not a number: the default)."""
    from gemmactl.runtime.engine.experts import ADMIT_ENV

    monkeypatch.delenv(ADMIT_ENV, raising=False)
    engine = _engine(moe_artifact, ExpertSettings(cache_bytes=None, policy="lru"))  # room for every expert
    experts = engine.experts
    blocks, k = len(experts.blocks), experts.top_k
    assert blocks >= 2 and k >= 2
    size = experts.store.stored_bytes
    chosen = [[0, 1] + list(range(2, k))] * blocks
    fetched = [[1] + [-1] * (k - 1), [5] + [-1] * (k - 1)] + [[-1] * k] * (blocks - 2)
    evicted, admitted = experts.keep_record(chosen, fetched)
    counters = experts.counters
    assert evicted == [] and len(admitted) == blocks * k  # every expert missed, every one kept
    assert counters.copied == blocks * k and counters.prefetch_hits == 1 and counters.prefetched == 2
    assert counters.decode_bytes == (blocks * k - 1 + 2) * size  # two fetched, the rest read in place
    evicted, admitted = experts.keep_record(chosen, [[-1] * k] * blocks)
    assert (evicted, admitted) == ([], []) and experts.cache.hits == blocks * k  # all cached now
    assert counters.decode_bytes == (blocks * k + 1) * size  # hits move nothing

    monkeypatch.setenv(ADMIT_ENV, "3")
    experts = _engine(moe_artifact, ExpertSettings(cache_bytes=None, policy="lru")).experts
    firsts = []
    for _ in range(2):
        _, admitted = experts.keep_record(chosen, [[-1] * k] * blocks)
        assert len(admitted) == 3
        firsts.append(admitted[0][0][0])  # the layer that went first
    assert firsts == [experts.blocks[0].layer, experts.blocks[1].layer]
    monkeypatch.setenv(ADMIT_ENV, "some")  # a measurement knob: anything else is the default
    assert _engine(moe_artifact, ExpertSettings(cache_bytes=None, policy="lru")).experts.admit_budget is None


def test_an_moe_step_is_captured_in_pieces_on_cuda_unless_turned_off(monkeypatch):
    from types import SimpleNamespace

    from gemmactl.runtime.engine.graph import GRAPH_ENV, moe_pieces_wanted
    from gemmactl.runtime.engine.placement import EnginePlacement

    model = SimpleNamespace(placement=EnginePlacement(("resident",) * 4, tables_on_host=True), experts=object(),
                            device=torch.device("cuda"))
    model.experts = SimpleNamespace(store=SimpleNamespace(arena=object()))
    for setting in ("auto", "on"):
        monkeypatch.setenv(GRAPH_ENV, setting)
        assert moe_pieces_wanted(model)  # the default on CUDA
    monkeypatch.setenv(GRAPH_ENV, "off")
    assert not moe_pieces_wanted(model)
    monkeypatch.setenv(GRAPH_ENV, "auto")
    model.experts.store.arena = None  # captured pieces read the arena's staging rows
    assert not moe_pieces_wanted(model)
    model.experts.store.arena = object()
    model.placement = EnginePlacement(("resident", "streamed", "resident", "resident"))
    assert not moe_pieces_wanted(model)
    model.placement, model.device = EnginePlacement(("resident",) * 4), torch.device("cpu")
    assert not moe_pieces_wanted(model)


def test_the_whole_step_asked_for_with_homed_experts_says_why_the_pieces_run(monkeypatch):
    from types import SimpleNamespace

    from gemmactl.runtime.engine.graph import MOE_ENV, moe_table_refused
    from gemmactl.runtime.engine.placement import EnginePlacement

    experts = SimpleNamespace(store=SimpleNamespace(arena=object(), homed={(1, 7)}), table_ready=lambda: False)
    model = SimpleNamespace(placement=EnginePlacement(("resident",) * 4), experts=experts,
                            device=torch.device("cuda"))
    monkeypatch.setenv(MOE_ENV, "table")
    assert moe_table_refused(model) == (f"{MOE_ENV}=table: experts are homed on the CPU (--expert-cpu-share), "
                                        "so the MoE step is captured in pieces")
    experts.store.homed = set()
    assert "grouped kernel's layout" in moe_table_refused(model)
    experts.table_ready = lambda: True
    assert moe_table_refused(model) is None  # it runs
    experts.table_ready = lambda: False
    monkeypatch.setenv(MOE_ENV, "pieces")
    assert moe_table_refused(model) is None  # not asked for
    monkeypatch.setenv(MOE_ENV, "table")
    model.device = torch.device("cpu")
    assert moe_table_refused(model) is None  # nothing is captured on the CPU


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["table", "table-prefetch", "pieces", "pieces-prefetch", "pieces-homed", "copies", "copies-prefetch",
                                  "pieces-prefetch-torch", "pieces-prefetch-after", "pieces-prefetch-fused",
                                  "pieces-homed-fused"])
def test_gpu_moe_step_captured_decodes_like_eager(moe_artifact, monkeypatch, mode):
    """On CUDA: (pieces, the default) graphs cut after each MoE layer's router, the misses copied
    into their rows between replays and each chosen expert read in its row (copies: every chosen
    expert copied into staging rows instead); or (table, asked for) the whole step in one graph,
    each chosen expert read where a device table says it lies (a cache slot, or its pinned host row
    over the link), the cache kept by the host after each token (graph_moe.TableDecode;
    table-prefetch: each layer's guessed misses fetched into ahead rows inside the step). The
    tokens of the eager step with the cache whole, small and off, under each policy, and a step's
    logits bit for bit. (pieces-prefetch: the pieces, each also guessing the next layer's
    experts, copied into the ahead rows while the next piece computes; pieces-homed: with prefetch,
    half of each layer's experts homed on the host, computed there between the pieces, their
    outputs crossing in place of their staging rows: the same tokens whatever the cache;
    -torch: the arena's copies queued by torch's copy_ rather than the driver's calls; -after: the
    next layer's guessed copies queued after the next piece's launch; -fused: the pieces fused by
    torch.compile before capture, whose rounding is not the eager step's: the same tokens whatever
    the cache and its policy, nothing compiled inside the capture, and a step's logits near the
    eager step's.)"""
    from gemmactl.runtime.engine.graph import DecodeStep
    from gemmactl.runtime.engine.graph_moe import PiecewiseDecode, TableDecode
    from gemmactl.runtime.engine.kernels import int4_groups_kept
    from gemmactl.runtime.engine.model import GemmaModel

    if mode.startswith("table") and not int4_groups_kept(expert=True):
        pytest.skip("the table step needs the experts in the Triton kernels' layout (Triton missing)")
    monkeypatch.setenv("GEMMACTL_ENGINE_GRAPH", "auto")
    parts = mode.split("-")
    prefetch = "prefetch" in parts or "homed" in parts
    share = 0.5 if "homed" in parts else None
    monkeypatch.setenv(COPIES_ENV, "torch" if "torch" in parts else "driver")
    fused = "fused" in parts
    monkeypatch.setenv("GEMMACTL_ENGINE_COMPILE", "on" if fused else "off")
    first = None
    monkeypatch.setenv("GEMMACTL_ENGINE_MOE", mode.split("-")[0])
    expert_bytes = None
    # (with prefetch, 2 × top_k = 4 of the slots are its ahead rows: 6 and 8 leave the cache 2 and 4)
    for slots, policy in ((None, "lfu"), (6, "lfu"), (6, "lru"), (8, "hot"), (0, "lfu")):
        settings = ExpertSettings(cache_bytes=None if slots is None else slots * expert_bytes, policy=policy,
                                  prefetch=prefetch, cpu_share=share)
        engine = GemmaModel(moe_artifact, device="cuda", dtype=torch.bfloat16, context=64, experts=settings)
        expert_bytes = engine.experts.store.expert_bytes
        expected, _ = engine_greedy(engine, PROMPT, STEPS)  # eager, bounded
        step = DecodeStep(engine)
        if mode.startswith("table"):
            assert isinstance(step.graph, TableDecode)
            assert engine.experts.fetching == (prefetch and slots is not None)  # all cached: nothing to fetch
        else:
            assert isinstance(step.graph, PiecewiseDecode) and step.graph.fused == step.compiled == fused
            assert step.graph.compiled_in_capture == 0  # fused: every piece compiled in the warm-up, none inside
            step.graph.ahead_after_launch = "after" in parts
            assert engine.experts.store.arena.addressed == (mode.startswith("pieces") and int4_groups_kept(expert=True))
            assert len(step.graph.graphs) == len(step.graph.calls) + 1 == sum(1 for layer in engine.layers if layer.moe) + 1
        tokens, _ = engine_greedy(engine, PROMPT, STEPS, decoder=step)
        if not fused:
            assert tokens == expected, (slots, policy)
        first = first or tokens
        if share or fused:  # which device computes an expert, or where it is read, does not depend on the cache
            assert tokens == first, (slots, policy)
        stats = engine.experts.stats()
        assert (stats["host_share"] > 0) == bool(share)
        assert stats["copies"] == ("torch" if "torch" in parts else "driver")  # libcuda opens on a GPU machine
        assert stats["copied"] == stats["misses"] and (slots != 0 or stats["hits"] == 0)
        assert stats["hits"] + stats["misses"] > 0
        if prefetch and slots is not None:  # guessed misses came from the ahead rows
            assert 0 < stats["prefetch_hits"] <= stats["prefetched"], (slots, policy)
        if mode.startswith("table") and slots == 6:  # the cache turned over while the steps read it
            assert engine.experts.cache.version > 3
        # One decode step's logits, eager and replayed, after the same prefill; the eager step without
        # its end, so its attention reads every slot (the unwritten ones masked) as the capture does.
        with torch.inference_mode():
            stepped = []
            for decoder in (None, step):
                engine_greedy(engine, PROMPT, 0)
                token, position = torch.tensor([expected[0]], device="cuda"), len(PROMPT)
                stepped.append((engine.step(token, torch.tensor([position], device="cuda"))
                                if decoder is None else decoder(token, position)).float().cpu())
        # Every one-token product of an expert runs in the grouped kernel, eager or captured: the same bits.
        # Fused, the stretches between are rounded as torch.compile writes them (norms and adds in
        # float32 where the eager step rounds to bfloat16 between): 12 random layers in bfloat16 moved
        # the largest logit difference to 7.8% of the largest logit on an H100 (0.059 of 0.76): a
        # loose bound, against gross errors; an expert read from a wrong row, which depends on the
        # cache, is what the tokens' agreement across caches above catches.
        if fused:
            assert (stepped[1] - stepped[0]).abs().max() <= 0.15 * stepped[0].abs().max(), (slots, policy)
        else:
            assert torch.equal(stepped[1], stepped[0]), (slots, policy, (stepped[1] - stepped[0]).abs().max())


def test_tokens_are_grouped_per_expert_in_transformers_order_from_one_read():
    """_token_groups: each expert's tokens by slot, then token, as taking them one expert at a time
    on the device gives them (torch.where, then by slot·T + token), for every expert chosen,
    ascending."""
    from gemmactl.runtime.engine.experts import _token_groups

    generator = torch.Generator().manual_seed(3)
    for tokens, k, count in ((1, 2, 8), (7, 2, 8), (64, 8, 128), (300, 4, 16)):
        experts = torch.stack([torch.randperm(count, generator=generator)[:k] for _ in range(tokens)])
        groups = _token_groups(experts)
        assert [expert for expert, _, _ in groups] == torch.unique(experts).tolist()
        for expert, positions, slots in groups:
            where_positions, where_slots = torch.where(experts == expert)
            order = torch.argsort(where_slots * tokens + where_positions)
            assert torch.equal(positions, where_positions[order]) and torch.equal(slots, where_slots[order])
            assert positions.dtype == slots.dtype == torch.int64


def test_lru_evicts_the_least_recently_used():
    cache = ExpertCache(2, "lru")
    for key in ("a", "b"):
        assert cache.lookup(key) is None and cache.admit(key)[1] is None
    assert cache.lookup("a") is not None  # a is now the most recent
    assert cache.lookup("c") is None
    slot, evicted = cache.admit("c")
    assert evicted == "b" and slot is not None
    assert (cache.hits, cache.misses) == (1, 3)


def test_lfu_evicts_the_least_used_and_ages_its_counts(monkeypatch):
    monkeypatch.setattr(experts_module, "AGE_EVERY", 1000)
    cache = ExpertCache(2, "lfu")
    for key in ("a", "b"):
        cache.lookup(key)
        cache.admit(key)
    for _ in range(3):
        cache.lookup("a")  # a: 4 uses, b: 1
    cache.lookup("b")  # b is the most recent, but still the less used
    cache.lookup("c")
    assert cache.admit("c")[1] == "b"
    monkeypatch.setattr(experts_module, "AGE_EVERY", 1)
    before = dict(cache.counts)
    cache.lookup("c")
    assert cache.counts["a"] == before["a"] // 2  # halved: old favourites fade
    assert cache.uses["a"] == 4  # what the counters report is never decayed


def test_hot_pins_the_most_used_experts(monkeypatch):
    monkeypatch.setattr(experts_module, "AGE_EVERY", 10)
    cache = ExpertCache(4, "hot")  # 3 of 4 slots may be pinned
    for key in "abcd":
        cache.lookup(key)
        cache.admit(key)
    for key in "aaabbc":  # the tenth lookup learns the pinned set: a, b, c
        cache.lookup(key)
    assert cache.pinned == {"a", "b", "c"}
    for key in "efg":  # newcomers only ever take the unpinned slot
        cache.lookup(key)
        cache.admit(key)
    assert {"a", "b", "c"} <= set(cache.slots) and len(cache.slots) == 4


def test_the_cache_turned_off_keeps_nothing_and_unknown_policies_are_named():
    cache = ExpertCache(0)
    assert cache.lookup("a") is None and cache.admit("a") == (None, None) and not cache.slots
    with pytest.raises(ValueError, match="lru, lfu, hot"):
        ExpertCache(4, "fifo")


def test_the_miss_rule_prices_a_copy_against_the_host():
    stored, dense = 1 << 20, 4 << 20  # int4 codes with their scales, and the same in bfloat16
    fast_host = MissRule(link_bytes_s=5e9, host_bytes_s=100e9)  # 0.21 ms to copy, 0.08 ms on the host
    assert fast_host.choose(stored, dense, separate_device=True) == "cpu"
    assert MissRule(link_bytes_s=25e9, host_bytes_s=50e9).choose(stored, dense, separate_device=True) == "copy"
    assert fast_host.choose(stored, dense, separate_device=False) == "copy"  # no link to save


@pytest.fixture(scope="module")
def moe_run_artifact(tiny_checkpoint, tmp_path_factory):
    """The tiny MoE Gemma 4 with the real Gemma 4 tokenizer, as an int4-stream artifact for `run`."""
    from gemmactl.formats.int4.layout import QuantizeOptions
    from gemmactl.formats.int4.quantize import quantize_checkpoint

    folder = tmp_path_factory.mktemp("moe-run") / "artifact"
    quantize_checkpoint(tiny_checkpoint("moe"), folder, QuantizeOptions(group_size=32, shard_size=1 << 30))
    return folder


def _run(artifact, *options):
    import json

    from conftest import run_gemmactl

    proc = run_gemmactl(["run", "--model", str(artifact), "--raw", "--json", "--temperature", "0", "--max-tokens", "12",
                         *options, "The capital of France is"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def test_run_reports_the_expert_cache_it_was_given_and_answers_alike(moe_run_artifact):
    """`run` on an MoE artifact is the engine with its expert cache: the options reach it, the
    counters come back in --json, and the answer is the same with the cache off."""
    auto = _run(moe_run_artifact)
    experts = auto["model"]["engine"]["experts"]
    assert experts["policy"] == "lfu" and experts["capacity_experts"] == 96  # 12 layers × 8: room for all
    assert experts["hits"] > 0 and experts["hits"] + experts["misses"] > 0
    small = _run(moe_run_artifact, "--expert-cache", str(3 * experts["expert_bytes"]) + "B", "--expert-policy", "hot",
                 "--expert-prefetch")
    assert small["model"]["engine"]["experts"]["capacity_experts"] == 3
    assert small["model"]["engine"]["experts"]["policy"] == "hot"
    assert small["model"]["engine"]["experts"]["prefetched"] > 0
    off = _run(moe_run_artifact, "--expert-cache", "off")
    assert off["model"]["engine"]["experts"]["hits"] == 0
    assert auto["answer"] == small["answer"] == off["answer"] and auto["answer"]


def test_bench_reports_the_expert_cache_and_takes_its_options(moe_run_artifact):
    """`bench` on an MoE artifact measures the engine with the expert cache it is given and reports
    the cache's counters: in --json under the engine's target, and as a row of the text's setup."""
    import json

    from conftest import run_gemmactl

    options = ["bench", "--model", str(moe_run_artifact), "--prompts", "short", "--max-tokens", "4", "--repeat", "1"]
    proc = run_gemmactl([*options, "--json", "--expert-cache", "off", "--expert-policy", "lru"], timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(proc.stdout)
    experts = data["targets"]["gemmactl"]["experts"]
    model = data["manifest"]["model"]  # an artifact is named by its index
    assert model["format"] == "int4-stream" and model["quantization"] == "int4.g32"
    assert model["sha256_of"] == "index.json" and len(model["sha256"]) == 64 and model["size_bytes"] > 0
    assert experts["policy"] == "lru" and experts["capacity_experts"] == 0
    assert experts["hits"] == 0 and experts["misses"] > 0 and experts["link_bytes_per_token"] > 0
    proc = run_gemmactl([*options, "--no-expert-prefetch"], timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = next(line for line in proc.stdout.splitlines() if "hit rate" in line)
    assert "experts" in row and "lfu cache of 96" in row and "over the link per decoded token" in row, row
    proc = run_gemmactl([*options, "--expert-policy", "fifo"])
    assert proc.returncode == 2 and "lru, lfu, hot" in proc.stderr and "Traceback" not in proc.stderr


def test_expert_options_that_cannot_apply_are_one_line_each(moe_run_artifact, runner, isolated_home):
    from conftest import invoke

    result = invoke(runner, ["run", "--model", str(moe_run_artifact), "--expert-policy", "fifo", "hello"])
    assert result.exit_code != 0 and "lru, lfu, hot" in result.output and "Traceback" not in result.output
    result = invoke(runner, ["run", "--model", str(moe_run_artifact), "--expert-cache", "lots", "hello"])
    assert result.exit_code != 0 and "--expert-cache 'lots' is not a size" in result.output
    result = invoke(runner, ["run", "--model", str(moe_run_artifact), "--expert-cpu-share", "2", "hello"])
    assert result.exit_code != 0 and "--expert-cpu-share '2' is not a fraction from 0 to 1" in result.output
    assert "Traceback" not in result.output
    result = invoke(runner, ["bench", "--model", str(moe_run_artifact), "--expert-cpu-share", "most"])
    assert result.exit_code != 0 and "--expert-cpu-share 'most' is not a fraction" in result.output
    result = invoke(runner, ["run", "--expert-cpu-share", "0.5", "hello"])  # the embedded GGUF: llama.cpp
    assert result.exit_code != 0 and "expert cache belongs to the int4 engine" in result.output
    result = invoke(runner, ["run", "--expert-cache", "1G", "hello"])  # the embedded GGUF: llama.cpp
    assert result.exit_code != 0 and "expert cache belongs to the int4 engine" in result.output


def test_a_plan_whose_experts_do_not_fit_the_ram_says_so_before_loading(moe_run_artifact, runner, isolated_home):
    """The experts stay in host memory (pinned on a GPU machine): a plan, and the engine's placement
    at load, refuse RAM that cannot hold them and the process, in one line naming what is needed."""
    from types import SimpleNamespace

    from conftest import invoke

    from gemmactl.errors import BudgetTooSmallError
    from gemmactl.plan.auto import engine_placement
    from gemmactl.plan.engine_map import HOST_MARGIN_BYTES

    options = ["plan", str(moe_run_artifact), "--backend", "int4", "--hardware", "desktop-4g", "--vram", "4G",
               "--context", "1024"]
    result = invoke(runner, [*options, "--ram", "1G"])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "in host memory (the MoE experts as stored" in result.output and "(--ram)" in result.output
    assert invoke(runner, [*options, "--ram", "32G"]).exit_code == 0
    machine = SimpleNamespace(gpus=[SimpleNamespace(index=0, memory_bytes=4 << 30)], ram_bytes=HOST_MARGIN_BYTES)
    with pytest.raises(BudgetTooSmallError, match="this machine's RAM"):
        engine_placement(moe_run_artifact, 256, vram=4 << 30, machine=machine)


def test_a_fused_forward_breaks_at_each_moe_layer_and_computes_what_the_eager_one_does(moe_artifact):
    """What the fused captured step (graph_moe.PiecewiseDecode, fused) relies on, on the CPU with
    torch.compile's graph-only backend: the compiled forward hands every MoE layer's experts to the
    hook in order (Dynamo breaks there and runs it untraced), the hook stages them and sums them in
    a function compiled on its own, the logits are the eager forward's, and a second call compiles
    nothing more."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from gemmactl.runtime.engine import graph_moe

    settings = ExpertSettings(cache_bytes=None, policy="lfu", miss="copy", arena=True, prefetch=False)
    engine = _staged_engine(moe_artifact, settings, addressed=True)
    moe_layers = [layer.spec.index for layer in engine.layers if layer.moe is not None]
    seen = []
    sums = CompileCounterWithBackend("aot_eager")
    staged_sum = torch.compile(graph_moe._staged_sum, dynamic=False, backend=sums)

    def work(call, summed=staged_sum):
        seen.append((call.block.layer, call.experts.tolist()))  # a host read, as the capture's cut makes
        call.block.stage(call.experts)
        return summed(call.block, call.x, call.weights, call.experts)

    counter = CompileCounterWithBackend("aot_eager")
    forward = torch.compile(engine.forward, dynamic=False, backend=counter)
    hook = graph_moe.cut_here(work)
    tokens, positions = torch.tensor([2]), torch.tensor([0])
    with torch.inference_mode():
        x, per_layer = engine.embed_tokens(tokens)
        expected = engine.forward(x, per_layer, positions, experts_of=lambda call: work(call, graph_moe._staged_sum))
        eager = list(seen)
        for run in range(2):
            engine.reset()
            seen.clear()
            with graph_moe.recompiles_allowed():
                logits = forward(x, per_layer, positions, experts_of=hook)
            assert torch.equal(logits, expected) and seen == eager, run
            frames = frames if run else (counter.frame_count, sums.frame_count)
    assert [layer for layer, _ in eager] == moe_layers
    # a stretch at least per MoE layer, a sum for each; none compiled again
    assert (counter.frame_count, sums.frame_count) == frames and min(frames) >= len(moe_layers)
