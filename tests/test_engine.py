"""The engine against transformers holding the same dequantized weights, on the CPU.

Both run in float32 from one int4-stream artifact, so any difference is the engine's: logits
must agree to within TOLERANCE of their scale, and greedy decoding token for token over 32
steps, past the sliding window (16 tokens in the tiny models) and across KV-shared layers.
"""

from __future__ import annotations

import pytest
import torch

from gemmactl.formats.int4.layout import QuantizeOptions
from gemmactl.formats.int4.quantize import quantize_checkpoint
from gemmactl.formats.int4.reader import open_artifact

TOLERANCE = 1e-4  # of the logits' largest magnitude: float32 sums in another order, nothing more
PROMPT = [2, 818, 5279, 529, 7001, 563, 496, 1401]  # BOS + a few ordinary tokens
STEPS = 32


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    from helpers.random_gemma import build_random_gemma

    made = {}

    def make(kind: str):
        if kind not in made:
            folder = tmp_path_factory.mktemp(f"engine-{kind}")
            source = build_random_gemma(kind, folder / "checkpoint")
            quantize_checkpoint(source, folder / "artifact", QuantizeOptions(group_size=32, shard_size=1 << 30))
            made[kind] = open_artifact(folder / "artifact")
        return made[kind]

    return make


def reference_greedy(model, prompt, steps):
    """transformers' greedy tokens (recomputing the whole sequence each step) and its first logits."""
    seq, tokens, first = list(prompt), [], None
    with torch.inference_mode():
        for _ in range(steps):
            logits = model(input_ids=torch.tensor([seq])).logits[0, -1]
            first = logits if first is None else first
            tokens.append(int(logits.argmax()))
            seq.append(tokens[-1])
    return tokens, first


def engine_greedy(engine, prompt, steps, chunk=None, decoder=None, bounded=True):
    """The engine's greedy tokens (prefill in chunks of `chunk`, then one token a step, through
    `decoder` when given) and its first logits (on the CPU). bounded: pass the end position, as
    eager callers do; else attention reads every slot, as a captured graph does."""
    device = engine.device
    engine.reset()
    chunk = chunk or len(prompt)
    with torch.inference_mode():
        for start in range(0, len(prompt), chunk):
            stop = min(len(prompt), start + chunk)
            logits = engine.step(torch.tensor(prompt[start:stop], device=device), torch.arange(start, stop, device=device),
                                 stop if bounded else None)
        first, tokens, position = logits.cpu(), [], len(prompt)
        for _ in range(steps):
            tokens.append(int(logits.argmax()))
            token = torch.tensor(tokens[-1:], device=device)
            if decoder is not None:
                logits = decoder(token, position)
            else:
                logits = engine.step(token, torch.tensor([position], device=device), position + 1 if bounded else None)
            position += 1
    return tokens, first


def test_a_kv_cache_lives_on_the_host_only_when_every_reader_runs_there():
    """Layers 0 and 1 own their caches; 2 reads 0's, 3 reads 1's (Gemma 4's KV sharing)."""
    from types import SimpleNamespace

    from gemmactl.runtime.engine.placement import HOST, RESIDENT, STREAMED, caches_on_host

    layers = [SimpleNamespace(index=i, kv_from=f) for i, f in enumerate((0, 1, 0, 1))]
    assert caches_on_host(layers, (HOST, HOST, HOST, HOST)) == {0, 1}
    assert caches_on_host(layers, (HOST, HOST, RESIDENT, HOST)) == {1}  # a GPU reader keeps 0's on the device
    assert caches_on_host(layers, (RESIDENT, HOST, STREAMED, STREAMED)) == set()  # a host owner read on the GPU
    assert caches_on_host(layers, (RESIDENT,) * 4) == set()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, keys", [(1, 1), (1, 37), (1, 600), (5, 37), (16, 600)])
def test_key_scores_and_weighted_values_are_the_einsums_they_replace(dtype, rows, keys):
    """The attention's q·k and its weights' product with the values, each one product per KV head
    over the cache's own layout: the einsums' values for one query row (a decode step) on the CPU,
    bit for bit in bfloat16; in float32 bit for bit where the CPU's BLAS takes the same path for
    both shapes (the Intel hosts measured), else within float32 rounding (an AMD EPYC host: the
    key scores 6e-7 of their largest value apart)."""
    from gemmactl.runtime.engine.ops import key_scores, weighted_values

    torch.manual_seed(0)
    qg, k = torch.randn(rows, 2, 4, 64, dtype=dtype), torch.randn(keys, 2, 64, dtype=dtype)
    weights, v = torch.softmax(torch.randn(rows, 2, 4, keys), -1).to(dtype), torch.randn(keys, 2, 64, dtype=dtype)
    pairs = [(key_scores(qg, k), torch.einsum("tkgd,skd->tkgs", qg, k)),
             (weighted_values(weights, v), torch.einsum("tkgs,skd->tkgd", weights, v))]
    assert pairs[0][0].shape == (rows, 2, 4, keys) and pairs[1][0].shape == (rows, 2, 4, 64)
    for ours, expected in pairs:
        assert ours.shape == expected.shape
        if rows == 1 and dtype == torch.bfloat16:
            assert torch.equal(ours, expected)
        elif rows == 1:
            assert (ours - expected).abs().max() <= 1e-6 * expected.abs().max()
        else:
            tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5
            assert torch.allclose(ours.float(), expected.float(), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("kind", ["dense-ple", "shared-kv", "e2b-tiny", "e4b-tiny", "gemma3-tiny", "moe"])
def test_engine_logits_and_greedy_tokens_equal_transformers(artifacts, kind):
    from gemmactl.runtime.engine.model import GemmaModel
    from gemmactl.runtime.int4_model import build_model

    artifact = artifacts(kind)
    reference = build_model(artifact, torch.float32)
    expected, expected_logits = reference_greedy(reference, PROMPT, STEPS)
    engine = GemmaModel(artifact, device="cpu", dtype=torch.float32, context=64)
    for bounded in (True, False):
        tokens, logits = engine_greedy(engine, PROMPT, STEPS, bounded=bounded)
        assert (logits - expected_logits).abs().max() <= TOLERANCE * expected_logits.abs().max()
        assert tokens == expected
    # Sliding layers keep a ring of the window (16) while full-attention ones keep every position.
    rings = [cache for cache in engine.caches.values() if cache.ring]
    assert rings and all(cache.slots == 16 for cache in rings)
    if kind == "shared-kv":
        assert len(engine.caches) == 5  # the last five layers read their producers' caches


@pytest.mark.parametrize("kind", ["e2b-tiny", "gemma3-tiny"])
def test_an_int4_head_of_its_own_decodes_as_transformers_holding_it(kind, tmp_path):
    """`quantize --head int4`: the engine multiplies by the artifact's int4 head (not the int8
    table), as transformers does holding the same dequantized weights; and the engine's map
    counts the smaller head."""
    from pathlib import Path

    from gemmactl.plan.engine_map import _costs, _index_and_spec
    from gemmactl.runtime.engine.kernels import linear_bytes
    from gemmactl.runtime.engine.model import GemmaModel
    from gemmactl.runtime.int4_model import build_model
    from helpers.random_gemma import build_random_gemma

    source = build_random_gemma(kind, tmp_path / "checkpoint")
    made = {}
    for head in ("tied", "int4"):
        quantize_checkpoint(source, tmp_path / head, QuantizeOptions(group_size=32, head=head))
        made[head] = open_artifact(tmp_path / head)
    artifact = made["int4"]
    assert artifact.record("lm_head.weight").scheme == "int4"
    expected, expected_logits = reference_greedy(build_model(artifact, torch.float32), PROMPT, STEPS)
    engine = GemmaModel(artifact, device="cpu", dtype=torch.float32, context=64)
    tokens, logits = engine_greedy(engine, PROMPT, STEPS)
    assert (logits - expected_logits).abs().max() <= TOLERANCE * expected_logits.abs().max()
    assert tokens == expected
    _, tied_logits = engine_greedy(GemmaModel(made["tied"], device="cpu", dtype=torch.float32, context=64), PROMPT, STEPS)
    assert not torch.equal(tied_logits, logits)  # a head of its own, not the table
    # The map counts the head as the kernel will hold it (tiny widths pad to tinygemm's tile; at
    # E4B's, 262,144 × 2,560, int4 in groups of 32 takes 0.62 of the int8 table's bytes).
    heads = {head: _costs(*_index_and_spec(Path(made[head].path)), 64)[1]["head"] for head in made}
    shape = artifact.record("lm_head.weight").shape
    assert heads == {"tied": linear_bytes("int8", shape, None, cuda=True), "int4": linear_bytes("int4", shape, 32, cuda=True)}
    e4b = (262144, 2560)
    assert linear_bytes("int4", e4b, 32, cuda=True) < 0.65 * linear_bytes("int8", e4b, None, cuda=True)
    from gemmactl.plan.inventory import inventory_from_int4

    inventory = inventory_from_int4(tmp_path / "int4")  # llama.cpp's side of the plan: the head is not the table
    assert not inventory.output_tied and inventory.globals["output"] == artifact.record("lm_head.weight").nbytes
    assert inventory_from_int4(tmp_path / "tied").output_tied


def test_a_tied_int4_table_is_counted_as_the_int4_head_the_engine_makes(tmp_path, monkeypatch):
    """With --embeddings int4 the tied head is the table's record in an int4 kernel (make_linear),
    not a bfloat16 copy: the map once counted an E4B shape's as 1,342 MB instead of about 380.
    (The tiny width is below tinygemm's tile, so the Triton kernel's layout, kept as stored, is
    the int4 one here.)"""
    from gemmactl.plan.engine_map import _costs, _index_and_spec
    from gemmactl.runtime.engine.kernels import INT4_ENV, linear_bytes
    from helpers.random_gemma import write_random_int4

    monkeypatch.setenv(INT4_ENV, "groups")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    write_random_int4("e2b-tiny", tmp_path / "a", sensitive="int4", embeddings="int4")
    index, spec = _index_and_spec(tmp_path / "a")
    table = next(r for r in index["tensors"] if r["name"].endswith("embed_tokens.weight"))
    assert spec.tied and table["scheme"] == "int4" and table["group_size"]
    shape = tuple(table["shape"])
    head = _costs(index, spec, 64)[1]["head"]
    assert head == linear_bytes("int4", shape, table["group_size"], cuda=True) < shape[0] * shape[1] * 2 / 3


@pytest.mark.parametrize("kind", ["e2b-tiny", "gemma3-tiny", "moe"])
def test_every_placement_decodes_the_same_tokens(artifacts, kind):
    """All resident, half streamed, all on the host, mixed with tables in host memory: the same
    greedy tokens and logits (the CPU stands in for the device: the same copies, views and order)."""
    from gemmactl.runtime.engine.model import GemmaModel
    from gemmactl.runtime.engine.placement import HOST, RESIDENT, STREAMED, EnginePlacement

    artifact = artifacts(kind)
    n = GemmaModel(artifact, device="cpu", dtype=torch.float32, context=64).spec.n_layers
    placements = {
        "resident": EnginePlacement.all_resident(n),
        "half streamed": EnginePlacement((RESIDENT,) * (n // 2) + (STREAMED,) * (n - n // 2)),
        "host": EnginePlacement((HOST,) * n, tables_on_host=True),
        "mixed": EnginePlacement(tuple((STREAMED, HOST, RESIDENT)[i % 3] for i in range(n)), tables_on_host=True),
    }
    results = {}
    for name, placement in placements.items():
        engine = GemmaModel(artifact, device="cpu", dtype=torch.float32, context=64, placement=placement)
        results[name] = engine_greedy(engine, PROMPT, STEPS, chunk=5)
        if name == "half streamed":
            memory = engine.memory()
            assert engine.streamer.order == list(range(n // 2, n))
            assert memory["link_bytes_per_token"] >= engine.streamer.bytes_per_step > 0
            assert memory["staging_bytes"] == 2 * max(s.nbytes for s in engine.streamer.staged.values())
    # Prefill chunks that stream the host layers through the staging areas and compute them on
    # the device (as on CUDA), their caches staying on the host; not for MoE models.
    engine = GemmaModel(artifact, device="cpu", dtype=torch.float32, context=64, placement=placements["mixed"],
                        prefill_host_layers_on_device=True)
    if kind == "moe":
        assert engine.prefill_streamer is None
    else:
        assert engine.prefill_streamer is not None and engine.prefill_streamer.areas is engine.streamer.areas
        assert engine.prefill_streamer.order == [i for i in range(n) if placements["mixed"].layers[i] != RESIDENT]
        results["mixed, prefill on the device"] = engine_greedy(engine, PROMPT, STEPS, chunk=5)
    tokens, logits = results.pop("resident")
    for name, (other_tokens, other_logits) in results.items():
        assert other_tokens == tokens, name
        assert torch.equal(other_logits, logits), name


@pytest.mark.parametrize("kind", ["e2b-tiny", "gemma3-tiny"])
@pytest.mark.parametrize("layout", ["HRSH", "SHRS", "RRSS"])
def test_a_step_cut_around_the_host_layers_decodes_as_the_whole_step(artifacts, kind, layout):
    """The decode step in pieces (graph_host.py: the GPU stretches, each streamed layer beginning
    its own, the host's layers between them), run eagerly with the CPU standing in for the device:
    the tokens and logits of the whole step, layers on the host at the first and last place too."""
    from gemmactl.runtime.engine.graph_host import HostPiecesDecode, pieces_of
    from gemmactl.runtime.engine.model import GemmaModel
    from gemmactl.runtime.engine.placement import EnginePlacement

    artifact = artifacts(kind)
    n = GemmaModel(artifact, device="cpu", dtype=torch.float32, context=64).spec.n_layers
    kinds = {"R": "resident", "S": "streamed", "H": "host"}
    placement = EnginePlacement(tuple(kinds[layout[i % len(layout)]] for i in range(n)), tables_on_host=True)
    engine = GemmaModel(artifact, device="cpu", dtype=torch.float32, context=64, placement=placement)
    expected, expected_logits = engine_greedy(engine, PROMPT, STEPS)
    pieces = pieces_of(placement.layers)
    assert [i for piece in pieces for i in piece.layers] == list(range(n))
    assert all(piece.streamed is None or piece.streamed == piece.layers[0] for piece in pieces)
    assert not pieces[-1].host
    step = HostPiecesDecode(engine)
    assert not step.captured
    tokens, logits = engine_greedy(engine, PROMPT, STEPS, decoder=step)
    assert tokens == expected
    assert torch.equal(logits, expected_logits)

    from helpers.replayed_pieces import ReplayedPieces

    step = ReplayedPieces(engine, capture=True)  # the captured path's wiring, a stand-in for each graph
    assert step.captured and len(step.bodies) == len(pieces)
    tokens, logits = engine_greedy(engine, PROMPT, STEPS, decoder=step)
    assert tokens == expected
    assert (logits - expected_logits).abs().max() <= TOLERANCE * expected_logits.abs().max()


def test_the_pieces_of_a_step():
    from gemmactl.runtime.engine.graph_host import pieces_of

    r, s, h = "resident", "streamed", "host"
    cut = lambda kinds: [("H" if p.host else "G", p.layers, p.streamed) for p in pieces_of(kinds)]  # noqa: E731
    assert cut((r, r, s, r, h, h, s, s)) == [("G", [0, 1], None), ("G", [2, 3], 2), ("H", [4, 5], None),
                                             ("G", [6], 6), ("G", [7], 7)]
    assert cut((h, r, h)) == [("H", [0], None), ("G", [1], None), ("H", [2], None), ("G", [], None)]


@pytest.mark.parametrize("kind", ["e2b-tiny", "gemma3-tiny"])
def test_attention_in_blocks_of_query_rows_equals_one_block(artifacts, kind, monkeypatch):
    """A prefill chunk's attention takes its query rows in blocks whose scores stay under a bound
    (spec.score_rows), so long contexts do not hold a chunk × context score matrix at once: here
    a bound of a few rows, against the whole chunk at once, gives the same tokens and logits."""
    from gemmactl.runtime.engine import spec as spec_module
    from gemmactl.runtime.engine.model import GemmaModel

    artifact = artifacts(kind)
    engine = GemmaModel(artifact, device="cpu", dtype=torch.float32, context=64)
    expected = engine_greedy(engine, PROMPT, STEPS)
    heads = max(layer.heads for layer in engine.spec.layers)
    monkeypatch.setattr(spec_module, "SCORES_BLOCK_BYTES", 3 * heads * len(PROMPT) * spec_module.SCORE_BYTES)
    assert spec_module.score_rows(heads, len(PROMPT)) == 3 < len(PROMPT)  # the prefill's rows in blocks of 3
    blocks = []
    attend = GemmaModel._attend
    monkeypatch.setattr(GemmaModel, "_attend", lambda self, *a: blocks.append(a[1].shape[0]) or attend(self, *a))
    tokens, logits = engine_greedy(engine, PROMPT, STEPS)
    assert max(blocks) <= 3 and blocks.count(3) >= len(engine.spec.layers)
    assert tokens == expected[0]
    assert torch.allclose(logits, expected[1], rtol=1e-5, atol=1e-5)


def test_chunked_prefill_equals_one_pass(artifacts):
    from gemmactl.runtime.engine.model import GemmaModel

    engine = GemmaModel(artifacts("shared-kv"), device="cpu", dtype=torch.float32, context=128)
    prompt = (PROMPT * 5)[:37]  # longer than the window, in chunks that straddle it
    whole = engine_greedy(engine, prompt, 8)
    chunked = engine_greedy(engine, prompt, 8, chunk=5)
    assert chunked[0] == whole[0]
    assert (chunked[1] - whole[1]).abs().max() <= TOLERANCE * whole[1].abs().max()


def test_the_int4_backend_is_the_engine_and_samples_as_asked(artifacts, monkeypatch):
    from gemmactl.runtime import backend_class
    from gemmactl.runtime.base import GenerationRequest
    from gemmactl.runtime.engine.backend import EngineBackend
    from gemmactl.runtime.engine.sampler import pick

    backend = backend_class("int4")
    logits = torch.tensor([0.1, 2.0, 1.9, -1.0])
    assert int(pick(logits.clone(), None, GenerationRequest(prompt="x", temperature=0), None)) == 1
    penalized = GenerationRequest(prompt="x", temperature=0, repeat_penalty=2.0)
    assert int(pick(logits.clone(), torch.tensor([1]), penalized, None)) == 2
    wide = GenerationRequest(prompt="x", temperature=5.0, top_k=0, top_p=1.0)
    seeded = [int(pick(logits, None, wide, torch.Generator().manual_seed(7))) for _ in range(2)]
    assert seeded[0] == seeded[1]  # one seed, one draw
    spread = {int(pick(logits, None, wide, torch.Generator().manual_seed(seed))) for seed in range(64)}
    assert len(spread) > 1  # a hot temperature really samples
    assert backend.__name__ == "open_int4_backend" and EngineBackend.name == "int4"


@pytest.mark.real_model
def test_the_real_270m_through_the_engine(gemma3_hf_checkpoint, tmp_path):
    """The real Gemma 3 270M: the engine's greedy tokens are transformers' (both float32, same
    dequantized weights), and through `run` it answers Paris."""
    import json
    import subprocess
    import sys

    from gemmactl.runtime.engine.model import GemmaModel
    from gemmactl.runtime.int4_model import build_model

    quantize_checkpoint(gemma3_hf_checkpoint, tmp_path / "art", QuantizeOptions(group_size=32, shard_size=1 << 30))
    artifact = open_artifact(tmp_path / "art")
    prompt = [2, 26156, 236787, 2900, 563, 506, 5279, 529, 7001, 236881, 107, 7925, 236787]  # Question: …France?\nAnswer:
    expected, _ = reference_greedy(build_model(artifact, torch.float32), prompt, 12)
    tokens, _ = engine_greedy(GemmaModel(artifact, device="cpu", dtype=torch.float32, context=256), prompt, 12)
    assert tokens == expected
    proc = subprocess.run([sys.executable, "-m", "gemmactl", "run", "--model", str(tmp_path / "art"), "--json",
                           "--stats", "--temperature", "0", "--max-tokens", "8", "What is the capital of France?"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert "Paris" in result["answer"] and result["model"]["backend"] == "int4"
    engine = result["model"]["engine"]
    assert engine["device"] == "cpu" and engine["placement"] == f"{artifact.config['num_hidden_layers']} resident"
    assert engine["weights_device_bytes"] > 0 and engine["link_bytes_per_token"] == 0
    assert "engine: cpu " in proc.stderr and "resident" in proc.stderr


gpu = pytest.mark.gpu  # the GPU tier: skipped without CUDA (tests/conftest.py), run by benchmarks/gpu_tests.sh


@gpu
@pytest.mark.parametrize("kind", ["dense-ple", "shared-kv", "e2b-tiny", "gemma3-tiny"])
def test_gpu_engine_with_its_captured_step_equals_transformers(artifacts, kind, monkeypatch):
    """On a GPU, in float32 with dense weights: the captured decode step gives transformers' tokens;
    in bfloat16 with the int4 kernels, logits stay close (their scales and zeros are bfloat16)."""
    from gemmactl.runtime.engine.graph import DecodeStep
    from gemmactl.runtime.engine.model import GemmaModel
    from gemmactl.runtime.int4_model import build_model

    artifact = artifacts(kind)
    expected, expected_logits = reference_greedy(build_model(artifact, torch.float32), PROMPT, STEPS)
    monkeypatch.setenv("GEMMACTL_ENGINE_KERNEL", "dense")
    monkeypatch.setenv("GEMMACTL_ENGINE_COMPILE", "off")
    engine = GemmaModel(artifact, device="cuda", dtype=torch.float32, context=64)
    step = DecodeStep(engine)
    assert step.graph is not None
    tokens, logits = engine_greedy(engine, PROMPT, STEPS, decoder=step)
    assert (logits - expected_logits).abs().max() <= 1e-3 * expected_logits.abs().max()  # TF32 matmuls
    assert tokens == expected


@pytest.mark.parametrize("layers, tables_on_host, setting, compile_, capture", [
    ("RRRR", False, "auto", True, True),    # resident: fused and captured
    ("RRSS", False, "auto", False, True),   # streamed: captured, never fused (copies on another stream)
    ("RRSS", False, "on", False, True),
    ("RRRR", True, "auto", True, True),     # tables in host memory: fused between the rows gathered outside
    ("RRSH", False, "on", False, False),    # a layer on the host cannot be captured whole (graph_host.py: in pieces)
    ("RRRR", False, "off", False, False),
])
def test_what_is_compiled_and_captured_follows_the_placement(layers, tables_on_host, setting, compile_, capture,
                                                             monkeypatch):
    from types import SimpleNamespace

    from gemmactl.runtime.engine.graph import COMPILE_ENV, GRAPH_ENV, wanted
    from gemmactl.runtime.engine.placement import EnginePlacement

    kinds = {"R": "resident", "S": "streamed", "H": "host"}
    model = SimpleNamespace(placement=EnginePlacement(tuple(kinds[k] for k in layers), tables_on_host=tables_on_host),
                            experts=None, device=torch.device("cuda"))
    monkeypatch.setenv(COMPILE_ENV, "auto" if setting == "on" else setting)
    monkeypatch.setenv(GRAPH_ENV, setting)
    assert (wanted(COMPILE_ENV, model), wanted(GRAPH_ENV, model)) == (compile_, capture)
    model.device = torch.device("cpu")  # no GPU: eager, unless capture is forced for a resident model
    assert not wanted(GRAPH_ENV, model) or (setting == "on" and model.placement.resident_only)
    assert not wanted(COMPILE_ENV, model)  # never compiled off CUDA


@pytest.mark.parametrize("layers, compile_setting, graph_setting, device, fused", [
    ("RRRR", "on", "auto", "cuda", True),    # the step between the gathered rows is fused
    ("RRRR", "max", "auto", "cuda", True),
    ("RRRR", "auto", "auto", "cuda", True),   # by default (measured: 220 tok/s against 93 unfused)
    ("RRRR", "off", "auto", "cuda", False),
    ("RRRS", "on", "auto", "cuda", False),   # a streamed layer's copies run on their own stream
    ("RRRR", "on", "off", "cuda", False),    # nothing captured: nothing to start from gathered rows
    ("RRRR", "on", "auto", "cpu", False),
])
def test_a_resident_step_with_its_tables_in_host_memory_is_fused_unless_turned_off(layers, compile_setting,
                                                                                  graph_setting, device, fused,
                                                                                  monkeypatch):
    from types import SimpleNamespace

    from gemmactl.runtime.engine.graph import COMPILE_ENV, GRAPH_ENV, wanted
    from gemmactl.runtime.engine.placement import EnginePlacement

    kinds = {"R": "resident", "S": "streamed"}
    model = SimpleNamespace(placement=EnginePlacement(tuple(kinds[k] for k in layers), tables_on_host=True),
                            experts=None, device=torch.device(device))
    monkeypatch.setenv(COMPILE_ENV, compile_setting)
    monkeypatch.setenv(GRAPH_ENV, graph_setting)
    assert wanted(COMPILE_ENV, model) == fused


@gpu
@pytest.mark.parametrize("kind", ["e2b-tiny", "e4b-tiny"])
def test_gpu_streamed_layers_are_captured_and_decode_like_eager(artifacts, kind, monkeypatch):
    """Half the layers streamed and the tables in host memory: the step is captured (copies and
    their events in the graph, the rows gathered outside it) and gives the eager step's tokens
    and logits, which it would not if a replay read a staging area before its copy landed."""
    from gemmactl.runtime.engine.graph import DecodeStep
    from gemmactl.runtime.engine.model import GemmaModel
    from gemmactl.runtime.engine.placement import RESIDENT, STREAMED, EnginePlacement

    monkeypatch.setenv("GEMMACTL_ENGINE_KERNEL", "dense")
    monkeypatch.delenv("GEMMACTL_ENGINE_GRAPH", raising=False)  # the default captures a streamed placement
    artifact = artifacts(kind)
    n = GemmaModel(artifact, device="cpu", dtype=torch.float32, context=64).spec.n_layers
    placement = EnginePlacement((RESIDENT,) * (n // 2) + (STREAMED,) * (n - n // 2), tables_on_host=True)
    engine = GemmaModel(artifact, device="cuda", dtype=torch.float32, context=64, placement=placement)
    expected, expected_logits = engine_greedy(engine, PROMPT, STEPS)  # eager, bounded
    step = DecodeStep(engine)
    assert step.graph is not None and not step.compiled
    tokens, logits = engine_greedy(engine, PROMPT, STEPS, decoder=step)
    assert (logits - expected_logits).abs().max() <= 1e-3 * expected_logits.abs().max()
    assert tokens == expected


@gpu
@pytest.mark.parametrize("kind", ["e2b-tiny", "gemma3-tiny"])
def test_gpu_a_fused_step_with_its_tables_in_host_memory_decodes_like_eager(artifacts, kind, monkeypatch):
    """Every layer resident, the tables in host memory, compile on: model.forward is fused
    and captured from the rows gathered on the host, and gives the eager step's tokens."""
    from gemmactl.runtime.engine.graph import COMPILE_ENV, DecodeStep
    from gemmactl.runtime.engine.model import GemmaModel
    from gemmactl.runtime.engine.placement import RESIDENT, EnginePlacement

    monkeypatch.setenv("GEMMACTL_ENGINE_KERNEL", "dense")
    monkeypatch.delenv("GEMMACTL_ENGINE_GRAPH", raising=False)
    monkeypatch.setenv(COMPILE_ENV, "on")
    artifact = artifacts(kind)
    n = GemmaModel(artifact, device="cpu", dtype=torch.float32, context=64).spec.n_layers
    placement = EnginePlacement((RESIDENT,) * n, tables_on_host=True)
    engine = GemmaModel(artifact, device="cuda", dtype=torch.float32, context=64, placement=placement)
    expected, expected_logits = engine_greedy(engine, PROMPT, STEPS)  # eager, bounded
    step = DecodeStep(engine)
    assert step.graph is not None and step.compiled
    tokens, logits = engine_greedy(engine, PROMPT, STEPS, decoder=step)
    assert (logits - expected_logits).abs().max() <= 1e-3 * expected_logits.abs().max()
    assert tokens == expected


@gpu
@pytest.mark.parametrize("kind", ["e2b-tiny", "gemma3-tiny"])
@pytest.mark.parametrize("layout", ["HRSH", "SHRS"])
def test_gpu_a_step_captured_around_its_host_layers_decodes_like_eager(artifacts, kind, layout, monkeypatch):
    """Layers on the host between resident and streamed ones: the step is captured in pieces (a
    graph for each GPU stretch, the copies queued between replays, the host's layers eager), and
    gives the eager step's tokens and logits, which it would not if a replay read a staging area
    before its copy landed or the host read activations before they crossed."""
    from gemmactl.runtime.engine.graph import DecodeStep
    from gemmactl.runtime.engine.graph_host import HostPiecesDecode
    from gemmactl.runtime.engine.model import GemmaModel
    from gemmactl.runtime.engine.placement import EnginePlacement

    monkeypatch.setenv("GEMMACTL_ENGINE_KERNEL", "dense")
    monkeypatch.delenv("GEMMACTL_ENGINE_GRAPH", raising=False)
    artifact = artifacts(kind)
    n = GemmaModel(artifact, device="cpu", dtype=torch.float32, context=64).spec.n_layers
    kinds = {"R": "resident", "S": "streamed", "H": "host"}
    placement = EnginePlacement(tuple(kinds[layout[i % len(layout)]] for i in range(n)), tables_on_host=True)
    engine = GemmaModel(artifact, device="cuda", dtype=torch.float32, context=64, placement=placement)
    expected, expected_logits = engine_greedy(engine, PROMPT, STEPS)  # eager, bounded
    step = DecodeStep(engine)
    assert isinstance(step.graph, HostPiecesDecode) and step.graph.captured
    tokens, logits = engine_greedy(engine, PROMPT, STEPS, decoder=step)
    assert (logits - expected_logits).abs().max() <= 1e-3 * expected_logits.abs().max()
    assert tokens == expected


@gpu
@pytest.mark.parametrize("group_size, in_features", [(32, 768), (64, 768), (128, 768), (64, 704), (128, 704)])
def test_gpu_tinygemm_layout_decodes_the_int4_stream_weights(group_size, in_features):
    """tinygemm over the repacked codes = the dequantized weight's product, up to bfloat16 rounding
    of each group's scale and zero′ (what the kernel stores). 704 columns (26B-A4B's expert
    down_proj) are not a multiple of tinygemm's k tile: padded with zero weights."""
    from gemmactl.formats.int4.quant import dequantize_int4, quantize_int4
    from gemmactl.runtime.engine.kernels import Int4Linear, tinygemm_columns, tinygemm_layout

    torch.manual_seed(0)
    w = torch.randn(512, in_features, device="cuda")
    qweight, scales, zeros = quantize_int4(w, group_size)
    dense = dequantize_int4(qweight, scales, zeros, in_features)
    x = torch.randn(5, in_features, device="cuda", dtype=torch.bfloat16)
    columns = tinygemm_columns(in_features, group_size) if in_features % 128 else in_features
    packed, sz = tinygemm_layout(qweight, scales, zeros, in_features, columns=columns)
    assert sz.shape[0] == columns // group_size
    y = Int4Linear(packed, sz, group_size, 512, in_features, columns)(x).float()
    expected = x.float() @ dense.t()
    assert (y - expected).abs().max() <= 0.02 * expected.abs().max()


def _int8_rows(rows=300, cols=256, device="cpu"):
    from gemmactl.formats.int4.quant import dequantize_int8_rows, quantize_int8_rows

    torch.manual_seed(0)
    q, scales = quantize_int8_rows(torch.randn(rows, cols))
    return q.to(device), scales.to(device), dequantize_int8_rows(q, scales).to(device)


@pytest.mark.parametrize("tokens", [1, 7])
def test_int8_rows_in_blocks_equal_the_dequantized_product(tokens, monkeypatch):
    """The block path (prefill, eager steps) dequantizes a few rows at a time; the product is the
    whole dequantized matrix's, whatever the block size."""
    from gemmactl.runtime.engine import kernels

    monkeypatch.setattr(kernels, "INT8_BLOCK_VALUES", 256 * 64)  # 64 rows a block: 5 blocks, the last short
    q, scales, dense = _int8_rows()
    x = torch.randn(tokens, 256)
    y = kernels.Int8Linear(q, scales)(x)
    assert y.shape == (tokens, 300)
    assert torch.allclose(y, x @ dense.t(), rtol=1e-5, atol=1e-5)


def test_int8_gemv_tiles_follow_the_shape_and_the_setting(monkeypatch):
    """Tall matrices (a vocabulary head) and short, wide ones get the tiles measured for them; the
    setting forces one tile for every shape, and a malformed one says what it expects."""
    from gemmactl.runtime.engine import int8_gemv

    monkeypatch.delenv(int8_gemv.TILE_ENV, raising=False)
    int8_gemv.tile_for.cache_clear()
    assert int8_gemv.tile_for(262_144, 1536) == int8_gemv.TALL_TILE
    assert int8_gemv.tile_for(1536, 12_288) == int8_gemv.WIDE_TILE != int8_gemv.TALL_TILE
    # A wide matrix with few row blocks for its GPU splits K; a tall one never needs to.
    assert int8_gemv.split(256, 12_288, 132, int8_gemv.Tile(16, 256, 4))[0] > 1
    assert int8_gemv.split(262_144, 1536, 132, int8_gemv.TALL_TILE)[0] == 1
    monkeypatch.setenv(int8_gemv.TILE_ENV, "4,512,8,16")
    int8_gemv.tile_for.cache_clear()
    assert int8_gemv.tile_for(262_144, 1536) == int8_gemv.tile_for(1536, 6144) == (4, 512, 8, 16)
    for bad in ("4,500,8", "4,512", "a,b,c", "4,512,8,0"):
        monkeypatch.setenv(int8_gemv.TILE_ENV, bad)
        int8_gemv.tile_for.cache_clear()
        with pytest.raises(ValueError, match="ROWS,COLS,WARPS"):
            int8_gemv.tile_for(1536, 6144)
    int8_gemv.tile_for.cache_clear()


_INTERPRETED_GEMV = """
import os, torch, triton
from gemmactl.formats.int4.quant import dequantize_int8_rows, quantize_int8_rows
from gemmactl.runtime.engine import int8_gemv

torch.manual_seed(0)
q, scales = quantize_int8_rows(torch.randn(300, 1100))
dense = dequantize_int8_rows(q, scales)
x = torch.randn(1100)
int8_gemv._sms = lambda device: sms
seen = set()
for tile in ("", "16,256,4", "1,128,1,8"):  # the engine's own, and two that split K on larger GPUs
    os.environ[int8_gemv.TILE_ENV] = tile
    int8_gemv.tile_for.cache_clear()
    for sms in (1, 2, 4, 8, 16, 40, 80):
        seen.add(int8_gemv.split(300, 1100, sms, int8_gemv.tile_for(300, 1100)))
        y = int8_gemv.int8_rows_gemv(x, q, scales)
        err = (y - dense @ x).abs().max().item()
        assert err <= 1e-4 * (dense @ x).abs().max().item(), (tile, sms, err)
print(len(seen))
"""


def test_int8_rows_gemv_kernel_equals_the_dequantized_product():
    """The Triton GEMV run by Triton's interpreter on the CPU (a process of its own: the interpreter
    is chosen when Triton is imported), in the engine's tile and two others, with K split as GPUs
    of several sizes split it, on a matrix whose rows and columns are no multiple of the tile."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton", reason="Triton is not installed (it comes with torch's CUDA wheels)")
    proc = subprocess.run([sys.executable, "-c", _INTERPRETED_GEMV], capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(proc.stdout) >= 6  # several splits were tried


@gpu
def test_gpu_int8_rows_keep_their_bytes_and_match_the_dequantized_product():
    """One token through the Triton kernel, eager and inside a compiled, captured step; several
    tokens through the block path: all equal the dequantized product up to bfloat16 rounding."""
    from gemmactl.runtime.engine.kernels import Int8Linear, linear_bytes

    q, scales, dense = _int8_rows(4096, 1536, "cuda")
    linear = Int8Linear(q, scales)
    assert linear.nbytes() == linear_bytes("int8", (4096, 1536), None, cuda=True)
    x = torch.randn(3, 1536, device="cuda", dtype=torch.bfloat16)
    expected = x.float() @ dense.t()
    compiled = torch.compile(lambda v: linear(v), fullgraph=True, dynamic=False)
    compiled(x[:1])
    graph = torch.cuda.CUDAGraph()
    static = x[:1].clone()
    with torch.cuda.graph(graph):
        captured = compiled(static)
    graph.replay()
    for y, want in ((linear(x[:1]), expected[:1]), (captured, expected[:1]), (linear(x), expected)):
        assert (y.float() - want).abs().max() <= 0.02 * want.abs().max()


_INTERPRETED_TOKENS = """
import os, torch
from gemmactl.formats.int4.quant import dequantize_int8_rows, quantize_int8_rows
from gemmactl.runtime.engine import int8_gemv

os.environ[int8_gemv.TILE_ENV] = "16,256,4"  # a tile whose K splits on larger GPUs
torch.manual_seed(0)
q, scales = quantize_int8_rows(torch.randn(300, 1100))
dense = dequantize_int8_rows(q, scales)
seen = set()
for sms in (1, 8, 40):
    int8_gemv._sms = lambda device: sms
    for tokens in (2, 5, 16):
        x = torch.randn(tokens, 1100).to(torch.bfloat16)
        seen.add(int8_gemv.split(300, 1100, sms))
        y = int8_gemv.int8_rows_gemv(x, q, scales)
        want = x.float() @ dense.t()
        err = (y.float() - want).abs().max().item()
        assert y.shape == (tokens, 300) and err <= 0.01 * want.abs().max().item(), (sms, tokens, err)
        alone = torch.stack([int8_gemv.int8_rows_gemv(x[i], q, scales) for i in range(tokens)])
        assert torch.equal(y, alone), (sms, tokens)
print(len(seen))
"""


def test_int8_rows_kernel_gives_each_of_a_few_tokens_its_one_token_result():
    """A verify step's few tokens (2 to 16) through the GEMV in one launch, in Triton's interpreter,
    with K split as GPUs of several sizes split it: the dequantized product, and each row the one
    token's result bit for bit (the same products and sums in the same order)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton", reason="Triton is not installed (it comes with torch's CUDA wheels)")
    proc = subprocess.run([sys.executable, "-c", _INTERPRETED_TOKENS], capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(proc.stdout) >= 2


@gpu
def test_gpu_int8_rows_few_tokens_are_each_the_one_token_result():
    """2 to 16 tokens through the GEMV in one launch, eager and compiled inside a captured graph:
    each row equals the token alone bit for bit (the head's shape, split and not), and the
    dequantized product up to bfloat16 rounding; 17 tokens take the block path."""
    from gemmactl.runtime.engine.kernels import Int8Linear

    for rows, cols in ((262_144 // 16, 2560), (2560, 10240)):
        q, scales, dense = _int8_rows(rows, cols, "cuda")
        linear = Int8Linear(q, scales)
        for tokens in (2, 5, 16, 17):
            x = torch.randn(tokens, cols, device="cuda", dtype=torch.bfloat16)
            want = x.float() @ dense.t()
            y = linear(x)
            assert (y.float() - want).abs().max() <= 0.02 * want.abs().max(), tokens
            if tokens <= 16:
                assert torch.equal(y, torch.cat([linear(x[i:i + 1]) for i in range(tokens)])), (rows, tokens)
        static = torch.randn(5, cols, device="cuda", dtype=torch.bfloat16)
        compiled = torch.compile(lambda v: linear(v), fullgraph=True, dynamic=False)
        compiled(static)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = compiled(static)
        static.copy_(torch.randn(5, cols, device="cuda", dtype=torch.bfloat16))
        graph.replay()
        assert torch.equal(captured, torch.cat([linear(static[i:i + 1]) for i in range(5)]))


_INTERPRETED_NORM = """
import torch
from gemmactl.runtime.engine import ops, row_norm

torch.manual_seed(0)
checked = 0
for width in (64, 256, 300, 2560):
    scale = torch.rand(width) + 0.5
    for rows in (1, 2, 5, 16):
        x = (torch.randn(rows, width) * 3).to(torch.bfloat16)
        for w in (scale, None):
            y = row_norm.rms_norm_rows(x, w, 1e-6)
            alone = torch.cat([row_norm.rms_norm_rows(x[i:i + 1], w, 1e-6) for i in range(rows)])
            assert torch.equal(y, alone), (width, rows)
            want = ops.rms_norm(x, w, 1e-6)  # the CPU's torch arithmetic
            err = (y.float() - want.float()).abs().max().item()
            assert y.dtype == x.dtype and err <= 2 ** -7 * want.float().abs().max().item(), (width, rows, err)
            checked += 1
heads = torch.randn(3, 4, 256).to(torch.bfloat16)  # [T, N, D]: a norm over each head's values
assert torch.equal(row_norm.rms_norm_rows(heads, None, 1e-6).reshape(12, 256),
                   row_norm.rms_norm_rows(heads.reshape(12, 256), None, 1e-6))
print(checked)
"""


def test_row_norm_kernel_gives_each_row_its_own_result_whatever_rows_run_beside_it():
    """The norm's Triton kernel in Triton's interpreter on the CPU: a row of 2 to 16 equals the row
    normalized alone bit for bit, widths no power of two included, with and without a scale, and
    the torch arithmetic within a bfloat16 step."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton", reason="Triton is not installed (it comes with torch's CUDA wheels)")
    proc = subprocess.run([sys.executable, "-c", _INTERPRETED_NORM], capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(proc.stdout) == 32


def test_row_norm_warps_follow_the_width_alone():
    from gemmactl.runtime.engine.row_norm import warps_for

    assert [warps_for(b) for b in (64, 256, 512, 1024, 4096, 8192)] == [1, 1, 2, 4, 8, 8]


@gpu
def test_gpu_norms_and_dense_products_give_a_few_rows_each_their_one_row_result(monkeypatch):
    """On CUDA, eager and compiled inside a captured step (the norm's kernel asked for there): the
    engine's norm (row_norm.py) and a dense matrix (cuBLAS, whose kernel depends on the rows) give
    each of 2 to 16 rows the bits the row gets alone, and the norm matches the torch arithmetic
    within a bfloat16 step."""
    from gemmactl.runtime.engine import ops
    from gemmactl.runtime.engine.kernels import Linear

    monkeypatch.setattr(ops, "NORM_SETTING", "kernel")

    torch.manual_seed(0)
    weight = torch.randn(3000, 2560, device="cuda", dtype=torch.bfloat16) * 0.02
    linear, scale = Linear(weight), torch.rand(2560, device="cuda") + 0.5

    def step(x):
        return linear(ops.rms_norm(x, scale, 1e-6))

    for rows in (2, 5, 16):
        x = torch.randn(rows, 2560, device="cuda", dtype=torch.bfloat16) * 3
        y = step(x)
        assert torch.equal(y, torch.cat([step(x[i:i + 1]) for i in range(rows)])), rows
        normed = ops.rms_norm(x, scale, 1e-6)
        reference = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) * scale)
        assert (normed.float() - reference).abs().max() <= 2 ** -7 * reference.abs().max()
    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    one, few = torch.randn(1, 2560, device="cuda", dtype=torch.bfloat16), torch.randn(5, 2560, device="cuda",
                                                                                        dtype=torch.bfloat16)
    compiled(one), compiled(few)
    graphs = [torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()]
    with torch.cuda.graph(graphs[0]):
        out_one = compiled(one)
    with torch.cuda.graph(graphs[1]):
        out_few = compiled(few)
    few.copy_(torch.randn(5, 2560, device="cuda", dtype=torch.bfloat16))
    graphs[1].replay()
    rows = []
    for i in range(5):
        one.copy_(few[i:i + 1])
        graphs[0].replay()
        rows.append(out_one.clone())
    assert torch.equal(out_few, torch.cat(rows))


def test_an_artifact_the_engine_cannot_run_is_named_with_what_it_runs():
    from gemmactl.errors import UnsupportedModelError
    from gemmactl.runtime.engine.spec import model_spec

    with pytest.raises(UnsupportedModelError, match="Gemma 3 and Gemma 4 text models.*'llama'"):
        model_spec({"model_type": "llama", "hidden_size": 64}, {})


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_asked_for_without_it_is_one_line_pointing_at_the_cpu(artifacts):
    import os
    import subprocess
    import sys

    artifact = artifacts("dense-ple")
    proc = subprocess.run([sys.executable, "-m", "gemmactl", "run", "--model", str(artifact.path), "hello"],
                          capture_output=True, text=True, env={**os.environ, "GEMMACTL_INT4_DEVICE": "cuda"})
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert "GEMMACTL_INT4_DEVICE=cuda" in lines[0] and "no CUDA GPU" in lines[0] and "CPU" in proc.stderr
