"""The engine's KV cache modes (runtime/engine/kv.py) and YaRN on its global layers.

The quantizers are checked against what they promise (the Lloyd-Max distortion of a Gaussian,
int8's half step, lossless packing), the rotated read against plain attention, and the modes in
the engine on tiny random models: prefill whole or in chunks gives the same tokens, and the
distance from the bf16 cache grows as the bits shrink. YaRN is checked against transformers'
own YaRN on a tiny Gemma 3.
"""

from __future__ import annotations

import copy

import pytest
import torch

from gemmactl.runtime.engine.kv import TurboKVCache, make_cache
from gemmactl.runtime.engine.kv_modes import ENGINE_MODES, code_planes, compression, pair_bytes
from test_engine import PROMPT, TOLERANCE, artifacts, engine_greedy, reference_greedy  # noqa: F401 (fixture)


# The Lloyd-Max quantizer's mean squared error for a unit Gaussian, by bits (Max 1960).
GAUSSIAN_DISTORTION = {2: 0.1175, 3: 0.03454, 4: 0.009497, 5: 0.002499, 6: 0.0006495}


@pytest.mark.parametrize("mode", ["tq4", "tq3"])
def test_turbo_modes_reach_the_lloyd_max_distortion_of_a_gaussian(mode):
    """After the rotation, coordinates of any vector are near-Gaussian: the relative error of keys
    and of values is the quantizer's distortion for a unit Gaussian at their bits."""
    torch.manual_seed(0)
    cache = make_cache(mode, 512, 2, 256, False, torch.float32, "cpu")
    x = torch.randn(512, 2, 256) * torch.linspace(0.1, 10, 512).view(-1, 1, 1)  # any scale
    x[:, :, :8] += 5  # and not centred
    cache.write(x, x, torch.arange(512))
    turned = x @ cache.rotation
    for name, read in zip("kv", cache.read(512)):
        error = ((read - turned).pow(2).sum(-1) / turned.pow(2).sum(-1)).mean()
        distortion = GAUSSIAN_DISTORTION[cache.bits[name]]
        assert abs(float(error) - distortion) < 0.15 * distortion, name


def test_int8_errs_by_at_most_half_a_step_and_packing_is_lossless():
    torch.manual_seed(0)
    cache = make_cache("int8", 64, 2, 32, False, torch.float32, "cpu")
    x = torch.randn(64, 2, 32)
    cache.write(x, x, torch.arange(64))
    k, v = cache.read(64)
    step = x.abs().amax(-1, keepdim=True) / 127
    fp16_scale = x.abs() * 2.0**-11  # the scale is kept in fp16
    assert ((k - x).abs() <= step / 2 + fp16_scale + 1e-6).all() and torch.equal(k, v)
    for bits in (2, 3, 4, 5, 6):
        codes = torch.randint(0, 1 << bits, (5, 3, 64), dtype=torch.uint8)
        packed = TurboKVCache._pack(codes, bits)
        assert packed.shape[-1] == 64 * bits // 8 and torch.equal(TurboKVCache._unpack(packed, bits), codes)
        # As the fused read takes them: in 32-bit words, code d's main bits at bit d·W0 of the main
        # plane, its high bits at bit d·W1 of the plane after it, never across a word.
        words = packed.view(torch.int32).long() & 0xFFFFFFFF
        main, high = code_planes(bits)
        for d in (0, 7, 37, 63):
            code = (words[..., d * main // 32] >> (d * main % 32)) & ((1 << main) - 1)
            if high:
                code |= ((words[..., 64 * main // 32 + d * high // 32] >> (d * high % 32)) & ((1 << high) - 1)) << main
            assert torch.equal(code, codes[..., d].long()), (bits, d)


def test_each_mode_stores_what_its_size_rule_says():
    for mode in ENGINE_MODES:
        cache = make_cache(mode, 100, 2, 256, False, torch.bfloat16, "cpu")
        assert cache.nbytes() == 2 * 100 * pair_bytes(mode, 256) + 100 * 8  # K, V and each slot's position
    assert compression("tq4", 256) >= 3.5 and compression("tq3", 256) > compression("tq4", 256)


def test_reading_turned_vectors_gives_plain_attention():
    """softmax((qR)(kR)ᵀ)(vR)Rᵀ = softmax(qkᵀ)v for the orthogonal R the turbo caches use: what
    the engine's attention does with a rotated cache."""
    torch.manual_seed(0)
    rotation = TurboKVCache(1, 1, 64, False, torch.float64, "cpu", bits=4).rotation_f32.double()
    q, k, v = torch.randn(3, 64).double(), torch.randn(10, 64).double(), torch.randn(10, 64).double()
    plain = torch.softmax(q @ k.T, -1) @ v
    turned = torch.softmax((q @ rotation) @ (k @ rotation).T, -1) @ (v @ rotation) @ rotation.T
    assert torch.allclose(plain, turned, atol=1e-10)


def test_the_fused_read_refuses_head_dims_its_kernels_do_not_take():
    """A head dim that is not a power of two from 32 would give the kernels runs of words that are
    no power of two (tl.arange's rule): refused before any launch (the engine asks usable())."""
    from gemmactl.runtime.engine import kv_attention

    assert kv_attention.shape_fits(64) and kv_attention.shape_fits(512)
    assert not any(kv_attention.shape_fits(d) for d in (16, 48, 96, 192, 320))
    cache = make_cache("int8", 8, 1, 192, False, torch.float32, "cpu")
    parts = cache.fused_parts(8)
    with pytest.raises(ValueError, match="powers of two"):
        kv_attention.quantized_attention(torch.zeros(1, 1, 2, 192), *parts["k"], *parts["v"], cache.pos,
                                         torch.tensor([0]), 8, 8, 1.0, 0)


@pytest.mark.parametrize("ring", [False, True])
def test_writing_while_turning_the_queries_stores_what_write_does(ring):
    """TurboKVCache.write_turning where its kernel does not run (one product for queries, keys and
    values) stores the codes write stores, but where float rounding moves a coordinate across a
    level boundary, and returns the queries turned by the rotation. check_turned_write holds the
    kernel the same way."""
    torch.manual_seed(0)
    heads, kv_heads, dim = 4, 2, 64
    one, two = (make_cache("tq4", 8 if ring else 16, kv_heads, dim, ring, torch.float32, "cpu", seed=3)
                for _ in range(2))
    k, v = torch.randn(12, kv_heads, dim) + 0.5, torch.randn(12, kv_heads, dim)
    for cache in (one, two):
        cache.begin(k, v)
    q, positions = torch.randn(12, heads, dim), torch.arange(12)
    one.write(k, v, positions)
    turned = two.write_turning(q, k, v, positions)
    assert torch.allclose(turned, q @ two.rotation_f32, atol=1e-5)
    assert torch.equal(one.pos, two.pos)
    assert all(torch.allclose(one.scales[name].float(), two.scales[name].float(), rtol=1e-3) for name in "kv")
    for name in "kv":
        moved = (one.codes[name] != two.codes[name]).float().mean()
        assert moved <= 0.01, (name, float(moved))
        a, b = one.read(one.slots)[name == "v"], two.read(two.slots)[name == "v"]
        assert float((a - b).abs().max()) <= 0.5 * float(a.abs().max())


@pytest.mark.parametrize("kind", ["gemma3-tiny", "shared-kv"])
def test_modes_in_the_engine_chunked_or_not_and_their_distance_from_bf16(artifacts, kind, monkeypatch):
    """Prefill whole or in chunks across the sliding window: the same greedy tokens in every mode
    (a chunk sees its own keys as the cache gives them back; the centres come from the first
    chunk, here 17 tokens either way). Teacher-forced against the bf16 cache, the KL divergence
    grows as the bits shrink."""
    from gemmactl.runtime.engine import kv
    from gemmactl.runtime.engine.model import GemmaModel

    monkeypatch.setattr(kv, "CENTRE_TOKENS", 16)

    artifact = artifacts(kind)
    prompt = (PROMPT * 5)[:37]  # longer than the window (16)
    logits = {}
    for mode in ENGINE_MODES:
        engine = GemmaModel(artifact, device="cpu", dtype=torch.float32, context=64, kv_mode=mode)
        assert {cache.mode for cache in engine.caches.values()} == {mode}
        whole = engine_greedy(engine, prompt, 12)
        chunked = engine_greedy(engine, prompt, 12, chunk=17)
        assert chunked[0] == whole[0], mode
        # A chunk's sums run in another order, which can move a value across a quantization step.
        tolerance = TOLERANCE if mode == "bf16" else 10 * TOLERANCE
        assert (chunked[1] - whole[1]).abs().max() <= tolerance * whole[1].abs().max(), mode
        engine.reset()
        with torch.inference_mode():
            logits[mode] = torch.log_softmax(engine.step(torch.tensor(prompt), torch.arange(len(prompt)), len(prompt),
                                                         all_logits=True), -1)
    kld = {mode: float((logits["bf16"].exp() * (logits["bf16"] - logits[mode])).sum(-1).mean())
           for mode in ("int8", "tq4", "tq3")}
    assert 0 < kld["int8"] < kld["tq4"] < kld["tq3"], kld


def test_the_sliding_windows_take_their_own_mode(artifacts, monkeypatch):
    """GLOBAL/WINDOWS: the global layers' caches in the first mode, the sliding layers' windows in
    the second; a mode named twice is that mode (the same logits); prefill whole or in chunks
    gives the same tokens."""
    from gemmactl.runtime.engine import kv
    from gemmactl.runtime.engine.kv_modes import layer_mode
    from gemmactl.runtime.engine.model import GemmaModel
    from gemmactl.runtime.engine.spec import SLIDING

    monkeypatch.setattr(kv, "CENTRE_TOKENS", 16)
    assert (layer_mode("tq4/bf16", SLIDING), layer_mode("tq4/bf16", "full_attention")) == ("bf16", "tq4")
    assert layer_mode("tq3", SLIDING) == "tq3" and layer_mode(None, SLIDING) == "bf16"
    artifact = artifacts("gemma3-tiny")
    prompt = (PROMPT * 5)[:37]
    logits = {}
    for mode in ("tq4/bf16", "tq4/tq4", "tq4"):
        engine = GemmaModel(artifact, device="cpu", dtype=torch.float32, context=64, kv_mode=mode)
        kinds = {layer.index: layer.kind for layer in engine.spec.layers}
        assert {kinds[i] for i in engine.caches} == {SLIDING, "full_attention"}
        for index, cache in engine.caches.items():
            assert cache.mode == layer_mode(mode, kinds[index]), (mode, index)
        whole = engine_greedy(engine, prompt, 12)
        chunked = engine_greedy(engine, prompt, 12, chunk=17)
        assert chunked[0] == whole[0], mode
        logits[mode] = whole[1]
    assert torch.equal(logits["tq4/tq4"], logits["tq4"])
    assert not torch.equal(logits["tq4/bf16"], logits["tq4"])


def test_the_fused_read_takes_a_few_rows_only_while_their_scores_fit_a_block(artifacts, monkeypatch):
    """The fused read holds every slot's score of its rows: one row always (a decode step), more
    only while they fit a read block's room; past it a prompt's last few tokens read by blocks,
    and the plan keeps a block's room free, not sixteen rows of every slot's scores."""
    from gemmactl.runtime.engine import kv_attention, kv_modes
    from gemmactl.runtime.engine.kv_modes import (FUSED_ROWS_MAX, FUSED_SCORE_BYTES, READ_BLOCK_BYTES, fused_rows,
                                                  read_bytes)
    from gemmactl.runtime.engine.model import GemmaModel

    heads, long = 8, 131072  # an E4B-shaped global layer at its model's longest context
    assert fused_rows(1, heads, 1 << 24) == 1
    assert fused_rows(5, heads, 4096) == 5 and fused_rows(64, heads, 4096) == FUSED_ROWS_MAX
    rows = fused_rows(FUSED_ROWS_MAX, heads, long)
    assert 1 < rows < FUSED_ROWS_MAX and rows * heads * long * FUSED_SCORE_BYTES <= READ_BLOCK_BYTES
    # The room for the read of a prompt's last chunk of 16 tokens: with blocks this small, what is
    # left is the fused read's, and that is a decode step's one row of scores, not sixteen rows'.
    monkeypatch.setattr(kv_modes, "READ_BLOCK_BYTES", 1 << 20)
    assert read_bytes("tq4", long, heads, 2, 512, FUSED_ROWS_MAX) == read_bytes("tq4", long, heads, 2, 512, 1) \
        == FUSED_SCORE_BYTES * heads * long
    monkeypatch.undo()

    engine = GemmaModel(artifacts("gemma3-tiny"), device="cpu", dtype=torch.float32, context=64, kv_mode="tq4")
    layer = next(layer for layer in engine.layers if layer.spec.owns_kv)
    cache = engine.caches[layer.spec.index]
    monkeypatch.setattr(kv_attention, "usable", lambda *args: True)  # as on CUDA

    def fused(t: int, held: int = 64) -> bool:
        return engine._reads_fused(layer, cache, torch.zeros(t, layer.spec.heads, layer.spec.head_dim), held)

    assert fused(1) and fused(6)
    monkeypatch.setattr(kv_modes, "READ_BLOCK_BYTES", FUSED_SCORE_BYTES * layer.spec.heads * 64 * 3)
    assert fused(1) and fused(3) and not fused(6)  # six rows' scores outgrow the room: by blocks
    assert fused(6, held=32)  # fewer slots written: they fit


@pytest.mark.parametrize("kind", ["gemma3-tiny", "shared-kv"])
@pytest.mark.parametrize("mode", ["int8", "tq4"])
@pytest.mark.parametrize("bounded", [True, False])
def test_a_quantized_cache_read_by_blocks_attends_as_one_read(artifacts, kind, mode, bounded, monkeypatch):
    """Attention over a quantized cache longer than a read block goes block by block with a running
    softmax: the same greedy tokens as one read of the whole cache, logits within float rounding
    (and the codes it flips at a boundary),
    prefill in chunks and decode, reading only the written slots or every slot (as a captured step
    does); and the read never holds more than a block decoded."""
    from gemmactl.runtime.engine import kv_modes
    from gemmactl.runtime.engine.model import GemmaModel

    artifact = artifacts(kind)
    prompt = (PROMPT * 5)[:37]
    engine = GemmaModel(artifact, device="cpu", dtype=torch.float32, context=64, kv_mode=mode)
    whole = engine_greedy(engine, prompt, 12, chunk=17, bounded=bounded)
    cache = next(c for c in engine.caches.values() if not c.ring)
    monkeypatch.setattr(kv_modes, "READ_BLOCK_BYTES", 7 * cache.kv_heads * cache.head_dim * kv_modes.READ_TEMP_BYTES)
    assert cache.read_block == 7 < len(prompt)
    decoded = []
    read_range = type(cache).read_range
    monkeypatch.setattr(type(cache), "read_range",
                        lambda self, start, stop: decoded.append((stop - start, self.read_block))
                        or read_range(self, start, stop))
    blocks = engine_greedy(engine, prompt, 12, chunk=17, bounded=bounded)
    assert (7, 7) in decoded and all(n <= block for n, block in decoded)
    assert blocks[0] == whole[0]
    # Float rounding, and what it moves: a vector whose RMS rounds to the next fp16 scale in one run
    # and not the other takes other codes (seen: six codes of one global layer, 0.3% of the largest
    # logit), as does a coordinate within rounding of a level's boundary.
    assert (blocks[1] - whole[1]).abs().max() <= 50 * TOLERANCE * whole[1].abs().max()


def test_yarn_equals_transformers_yarn_on_a_tiny_gemma3(artifacts):
    """The engine with a YaRN factor on its global layers gives the logits and greedy tokens of
    transformers' Gemma 3 configured with the same YaRN rope, past the original context."""
    from gemmactl.runtime.engine.model import GemmaModel
    from gemmactl.runtime.engine.spec import yarn_config
    from gemmactl.runtime.int4_model import build_model

    artifact = artifacts("gemma3-tiny")
    scaled = copy.copy(artifact)
    scaled.index = {**artifact.index, "config": yarn_config(artifact.config, 4.0)}
    assert scaled.config["rope_parameters"]["full_attention"]["rope_type"] == "yarn"
    reference = build_model(scaled, torch.float32)
    expected, expected_logits = reference_greedy(reference, PROMPT, 16)
    engine = GemmaModel(artifact, device="cpu", dtype=torch.float32, context=64, yarn=4.0)
    tokens, logits = engine_greedy(engine, PROMPT, 16)
    assert (logits - expected_logits).abs().max() <= TOLERANCE * expected_logits.abs().max()
    assert tokens == expected
    plain = GemmaModel(artifact, device="cpu", dtype=torch.float32, context=64)
    assert not torch.equal(engine_greedy(plain, PROMPT, 1)[1], logits)  # the factor changed something


def test_yarn_where_it_cannot_apply_says_why(artifacts):
    from gemmactl.errors import GemmactlError
    from gemmactl.runtime.engine.spec import yarn_config

    config = dict(artifacts("gemma3-tiny").config)
    only_sliding = {**config, "layer_types": ["sliding_attention"] * int(config["num_hidden_layers"])}
    with pytest.raises(GemmactlError, match="global-attention layers, and this model has none"):
        yarn_config(only_sliding, 4.0)
    with pytest.raises(GemmactlError, match="at least 1"):
        yarn_config(config, 0.5)
    with pytest.raises(GemmactlError, match="'proportional' rope"):
        yarn_config(artifacts("dense-ple").config, 4.0)  # Gemma 4's global layers


def test_run_takes_the_kv_cache_mode_on_both_backends(tiny_checkpoint, tmp_path, runner, isolated_home):
    """The engine runs in the mode asked (and says so in --json); the embedded GGUF runs on
    llama.cpp with a q8_0 cache; a mode of the other backend, or YaRN on llama.cpp, is one line."""
    import json

    from conftest import invoke, run_gemmactl
    from gemmactl.formats.int4.layout import QuantizeOptions
    from gemmactl.formats.int4.quantize import quantize_checkpoint

    folder = tmp_path / "artifact"
    quantize_checkpoint(tiny_checkpoint("dense-ple"), folder, QuantizeOptions(group_size=32, shard_size=1 << 30))
    proc = run_gemmactl(["run", "--model", str(folder), "--raw", "--json", "--temperature", "0", "--max-tokens", "4",
                         "--kv-cache", "tq4", "Hello"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["model"]["engine"]["kv_cache"] == "tq4"
    proc = run_gemmactl(["run", "--model", str(folder), "--raw", "--json", "--temperature", "0", "--max-tokens", "4",
                         "--kv-cache", "tq4/bf16", "Hello"])
    assert proc.returncode == 0 and json.loads(proc.stdout)["model"]["engine"]["kv_cache"] == "tq4/bf16", proc.stderr[-2000:]
    result = invoke(runner, ["run", "--raw", "--temperature", "0", "--max-tokens", "6", "--kv-cache", "q8_0",
                             "The capital of France is"])
    assert result.exit_code == 0 and result.output.strip(), result.output
    for args, message in ((["--kv-cache", "tq4"], "not a KV cache mode of llama.cpp"),
                          (["--yarn", "4"], "YaRN factor is applied by the int4 engine"),
                          (["--model", str(folder), "--kv-cache", "q4_0"], "not a KV cache mode of the int4 engine"),
                          (["--model", str(folder), "--kv-cache", "tq4/q4_0"], "GLOBAL/WINDOWS"),
                          (["--kv-cache", "q8_0/f16"], "one KV cache type for every layer")):
        result = invoke(runner, ["run", *args, "hello"])
        assert result.exit_code != 0 and message in result.output and "Traceback" not in result.output, result.output


def test_llama_cpp_plans_size_the_kv_for_the_cache_type(embedded_gguf, model_home, runner):
    """plan and run's placement size a GGUF's KV for llama.cpp's type: q8_0 and q4_0 are ggml blocks
    of 32 values with an f16 scale (34 and 18 bytes), against 64 bytes in f16."""
    import json

    from conftest import invoke
    from gemmactl.plan.report import build_plan

    kv = {}
    for mode in (None, "f16", "q8_0", "q4_0"):
        plan = build_plan(str(embedded_gguf), vram="64G", context=4096, kv_cache=mode).plan
        kv[mode] = sum(layer.kv_bytes for layer in plan.layers)
    assert kv[None] == kv["f16"] > 0
    assert abs(kv["q8_0"] / kv["f16"] - 34 / 64) < 1e-3 and abs(kv["q4_0"] / kv["f16"] - 18 / 64) < 1e-3
    result = invoke(runner, ["plan", str(embedded_gguf), "--hardware", "desktop-4g", "--vram", "3G", "--context", "4096", "--kv-cache", "q4_0",
                             "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert sum(layer["bytes"]["kv"] for layer in data["layers"]) == kv["q4_0"]
    argv = " ".join(data["llama_cpp_args"]["argv"])
    assert "-ctk q4_0 -ctv q4_0 -fa on" in argv


@pytest.mark.parametrize("kind, yarn", [("gemma3-tiny", None), ("gemma3-tiny", 4.0), ("e2b-tiny", None),
                                        ("e4b-tiny", None)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_tables_equal_transformers_rotary_modules(artifacts, kind, yarn, dtype):
    """The engine's cos/sin rows, made from transformers' rope functions alone, equal its Gemma 3
    and Gemma 4 rotary modules' output bit for bit: every layer kind (Gemma 4's proportional rope
    on global layers with their own head dimension), with and without YaRN, in both dtypes; for a
    whole table and for the scattered positions of a step (what the engine makes each step)."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding

    from gemmactl.runtime.engine.spec import hf_text_config, rope_frequencies, rope_rows, yarn_config

    config = artifacts(kind).config
    hf = hf_text_config(yarn_config(config, yarn) if yarn else config)
    rotary = (Gemma3RotaryEmbedding if kind.startswith("gemma3") else Gemma4TextRotaryEmbedding)(hf)
    length = 300
    tables = {kind_name: rope_rows(torch.arange(length), inv_freq, scaling, dtype)  # every position: a whole table
              for kind_name, (inv_freq, scaling) in rope_frequencies(config, yarn).items()}
    assert set(tables) == set(hf.layer_types)
    for kind_name, (cos, sin) in tables.items():
        want_cos, want_sin = rotary(torch.zeros(1, dtype=dtype), torch.arange(length).unsqueeze(0), kind_name)
        assert torch.equal(cos, want_cos[0]) and torch.equal(sin, want_sin[0]), kind_name
    positions = torch.tensor([7, length - 1, 0, 150, 151])
    for kind_name, (inv_freq, scaling) in rope_frequencies(config, yarn).items():
        cos, sin = rope_rows(positions, inv_freq, scaling, dtype)
        want_cos, want_sin = rotary(torch.zeros(1, dtype=dtype), positions.unsqueeze(0), kind_name)
        assert torch.equal(cos, want_cos[0]) and torch.equal(sin, want_sin[0]), kind_name


def check_turned_write_compiled(device):
    """The write's kernel inside torch.compile (as the fused decode step runs it) stores what it
    stores eagerly and turns the queries alike: compile fuses the torch around the op, and must
    neither copy the cache nor round away what the op takes."""
    import torch

    from gemmactl.runtime.engine.kv import TurboKVCache, make_cache

    torch.manual_seed(3)
    one, two = (make_cache("tq4", 8, 2, 64, True, torch.float32, device, seed=6) for _ in range(2))
    first = torch.randn(6, 2, 64, device=device) * 2 + 0.5, torch.randn(6, 2, 64, device=device)
    for cache in (one, two):
        cache.begin(*first)

    def step(cache, q, k, v, positions):  # the norm before the write, as in the model
        return cache.write_turning(q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6), k, v, positions)

    compiled = torch.compile(step)
    for at in (0, 6):
        q = torch.randn(1, 4, 64, device=device) * 3
        k, v = torch.randn(1, 2, 64, device=device) * 2 + 0.5, torch.randn(1, 2, 64, device=device)
        positions = torch.tensor([at], device=device)
        want, got = step(one, q, k, v, positions), compiled(two, q, k, v, positions)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    assert torch.equal(one.pos, two.pos)
    for name in "kv":
        a, b = (TurboKVCache._unpack(c.codes[name], c.bits[name]).long() for c in (one, two))
        assert float((a != b).float().mean()) <= 0.01 and torch.equal(one.scales[name], two.scales[name]), name


def check_turned_write(device):
    """The write's kernel (kv_turn.py, TurboKVCache.write_turning where it runs) against the torch
    write (write): every turbo mode, head dims from 32 to 512, one or a few tokens, a ring that
    wraps. The same scales and the same codes but where the products' rounding moves a coordinate
    across a level's edge (then by one level), the queries turned as by the rotation."""
    import torch

    from gemmactl.runtime.engine import kv_turn
    from gemmactl.runtime.engine.kv import TurboKVCache, make_cache

    torch.manual_seed(1)
    for mode in ("tq4", "tq3"):
        for dim, rows, ring in ((32, 1, False), (64, 3, True), (256, 2, False), (512, 1, True)):
            assert kv_turn.usable(device, rows, dim), (mode, dim)
            one, two = (make_cache(mode, 8, 2, dim, ring, torch.float32, device, seed=5) for _ in range(2))
            first = torch.randn(6, 2, dim, device=device) * 2 + 0.5, torch.randn(6, 2, dim, device=device)
            for cache in (one, two):
                cache.begin(*first)
            for at in (0, 6):  # a ring of 8 wraps at the second
                positions = torch.arange(at, at + rows, device=device)
                q = torch.randn(rows, 4, dim, device=device) * 3
                k, v = torch.randn(rows, 2, dim, device=device) * 2 + 0.5, torch.randn(rows, 2, dim, device=device)
                one.write(k, v, positions)
                turned = two.write_turning(q, k, v, positions)
                want = q @ two.rotation_f32
                assert (turned - want).abs().max() <= 1e-5 * want.abs().max(), (mode, dim)
            assert torch.equal(one.pos, two.pos)
            for name in "kv":
                assert torch.allclose(one.scales[name].float(), two.scales[name].float(), rtol=1e-3), (mode, dim, name)
                a, b = (TurboKVCache._unpack(c.codes[name], c.bits[name]).long() for c in (one, two))
                moved = a != b
                assert float(moved.float().mean()) <= 0.01 and int((a - b).abs().max()) <= 1, (mode, dim, name)


_INTERPRETED_READ = """
import itertools, sys, torch
from gemmactl.formats.int4.reader import open_artifact
from gemmactl.runtime.engine import kv_attention
from gemmactl.runtime.engine.kv import make_cache
from gemmactl.runtime.engine.model import GemmaModel

# the kernel alone against attention over the decoded cache: every mode, unwritten slots, a window,
# grouped heads, several query rows at different positions, slots no multiple of a block (once); at
# the short caches' tiles and (every cache taken as long) the long caches'
torch.manual_seed(0)
short = kv_attention.SHORT_SLOTS
for mode, kv_attention.SHORT_SLOTS in itertools.product(("int8", "tq4", "tq3"), (short, 0)) \
        if sys.argv[2] == "alone" else ():
    for slots, heads, groups, dim, rows, window in ((40, 2, 4, 32, 1, 0), (37, 1, 8, 64, 3, 16), (70, 2, 2, 32, 2, 0),
                                                     (45, 2, 4, 256, 2, 0)):  # fields wide enough for tl.dot
        cache = make_cache(mode, slots, heads, dim, False, torch.float32, "cpu")
        written = slots - 3
        cache.begin(torch.randn(slots, heads, dim) + 0.5, torch.randn(slots, heads, dim))
        cache.write(torch.randn(written, heads, dim) * 2 + 0.5, torch.randn(written, heads, dim), torch.arange(written))
        k, v = cache.read(slots)
        q = torch.randn(rows, heads, groups, dim)
        positions = torch.tensor([written - 1 - 5 * i for i in range(rows)])
        scores = torch.einsum("tkgd,skd->tkgs", q, k) * 0.125
        seen = (cache.pos[None, :] <= positions[:, None]) & (cache.pos[None, :] >= 0)
        if window:
            seen &= cache.pos[None, :] > positions[:, None] - window
        want = torch.einsum("tkgs,skd->tkgd", torch.softmax(scores.masked_fill(~seen[:, None, None, :], -1e30), -1), v)
        parts = cache.fused_parts(slots)
        got = kv_attention.quantized_attention(q, *parts["k"], *parts["v"], cache.pos, positions, parts["k_bits"],
                                               parts["v_bits"], 0.125, window)
        assert (got - want).abs().max() <= 0.02 * want.abs().max(), (mode, slots, rows, window)
kv_attention.SHORT_SLOTS = short

# the write's kernel (kv_turn.py) against the torch write (check_turned_write, defined above)
kv_attention.os.environ[kv_attention.ENV] = "on"
if sys.argv[2] == "alone":
    check_turned_write("cpu")
    check_turned_write_compiled("cpu")

# the engine: at every read the fused path takes, the torch read of the same cache and queries
# beside it (compared call by call: a random tiny model's logits amplify float16 rounding over
# its layers and steps), prefill in chunks the kernel takes, then decode; reading the written
# slots or every slot, as a captured step does
artifact = open_artifact(sys.argv[1])
prompt = [2, 818, 5279, 529, 7001, 563, 496, 1401] * 3
fused, seen = GemmaModel._scores_fused, []


def both(self, layer, q, cache, held, positions, **turned):
    got = fused(self, layer, q, cache, held, positions, **turned)
    (k, v), key_positions = cache.read(held), cache.pos[:held]
    want = self._scores(layer, q, k, v, key_positions, positions, cache.rotation, cache.value_offset)
    seen.append((layer.spec.kind, q.shape[0], float((got - want).abs().max() / want.abs().max())))
    return got


GemmaModel._scores_fused = both
kv_attention.os.environ[kv_attention.ENV] = "on"
for mode in ("tq4", "tq3", "int8"):
    engine = GemmaModel(artifact, device="cpu", dtype=torch.float32, context=48, kv_mode=mode)
    for bounded in (True, False):
        engine.reset()
        with torch.inference_mode():
            for start in range(0, len(prompt), 6):
                stop = start + 6
                out = engine.step(torch.tensor(prompt[start:stop]), torch.arange(start, stop), stop if bounded else None)
            for position in range(len(prompt), len(prompt) + 6):
                out = engine.step(out.argmax().view(1), torch.tensor([position]), position + 1 if bounded else None)
assert {rows for _, rows, _ in seen} >= {1, 6}, seen
assert max(error for _, _, error in seen) <= 5e-3, max(seen, key=lambda x: x[2])
print("ok")
"""


@pytest.mark.parametrize("kind", ["gemma3-tiny", "shared-kv"])
def test_the_fused_read_of_a_quantized_cache_attends_as_the_torch_read(artifacts, kind):
    """The Triton kernel that reads a quantized cache's codes in place (kv_attention.py), run by
    Triton's interpreter on the CPU (a process of its own: the interpreter is chosen when Triton is
    imported; it has no bfloat16, so tl.dot takes float16 there): alone (once), against attention
    over the decoded cache for every mode; in the engine, each read it makes beside the torch read of
    the same cache and queries, prefill in chunks and decode, reading the written slots or every
    slot (as a captured step does). On CUDA the engine takes it by default."""
    import inspect
    import os
    import subprocess
    import sys

    pytest.importorskip("triton", reason="Triton is not installed (it comes with torch's CUDA wheels)")
    artifact = artifacts(kind)
    alone = "alone" if kind == "gemma3-tiny" else "engine"
    script = inspect.getsource(check_turned_write) + inspect.getsource(check_turned_write_compiled) \
        + _INTERPRETED_READ
    proc = subprocess.run([sys.executable, "-c", script, str(artifact.path), alone], capture_output=True,
                          text=True, env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")


@pytest.mark.gpu
def test_gpu_turned_write_stores_what_write_does(monkeypatch):
    """The write's kernel on CUDA (Triton compiled for the GPU, not the interpreter) against the
    torch write, as check_turned_write holds it."""
    monkeypatch.delenv("GEMMACTL_KV_KERNEL", raising=False)
    check_turned_write("cuda")
    check_turned_write_compiled("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["gemma3-tiny", "shared-kv"])
@pytest.mark.parametrize("mode", ["tq4", "int8"])
@pytest.mark.parametrize("compiled", ["off", "on"])
def test_gpu_fused_read_attends_as_the_torch_read_and_is_captured(artifacts, kind, mode, compiled, monkeypatch):
    """On CUDA the engine reads a quantized cache with the fused kernels: at each read they match the
    torch read of the same cache and queries (up to their float16 products), and the captured step
    gives the step's logits along its tokens. Captured as it is, the step is the eager one's
    kernels over every slot: the eager logits up to rounding. Fused by torch.compile, it rounds
    otherwise than the eager step, and in a quantized cache a difference of rounding now and then
    moves a code across a boundary, which a tiny random model turns into logits 7-25% of their
    largest apart (measured: CPU and GPU alike, main's read too; not with torch.compile's aot_eager
    backend, which keeps the eager arithmetic). So the fused step is held to the same fused step
    run uncaptured, and the read's ops compiled alone to the ops run eagerly (the compiled graph
    checks the ops' output strides against their fakes', which once failed there)."""
    from gemmactl.runtime.engine import kv_attention
    from gemmactl.runtime.engine.graph import DecodeStep
    from gemmactl.runtime.engine.model import GemmaModel

    monkeypatch.setenv("GEMMACTL_ENGINE_KERNEL", "dense")
    monkeypatch.setenv("GEMMACTL_ENGINE_COMPILE", compiled)
    monkeypatch.delenv("GEMMACTL_KV_KERNEL", raising=False)
    engine = GemmaModel(artifacts(kind), device="cuda", dtype=torch.float32, context=64, kv_mode=mode)
    fused, errors = GemmaModel._scores_fused, []

    def both(self, layer, q, cache, held, positions, **turned):
        got = fused(self, layer, q, cache, held, positions, **turned)
        (k, v), key_positions = cache.read(held), cache.pos[:held]
        want = self._scores(layer, q, k, v, key_positions, positions, cache.rotation, cache.value_offset)
        errors.append(float((got - want).abs().max() / want.abs().max()))
        return got

    monkeypatch.setattr(GemmaModel, "_scores_fused", both)
    expected, _ = engine_greedy(engine, PROMPT, 12)  # eager, bounded
    assert errors and max(errors) <= 1e-2, max(errors)  # an H100: 0.3% at most
    monkeypatch.setattr(GemmaModel, "_scores_fused", fused)
    step = DecodeStep(engine)
    assert step.graph is not None and step.compiled == (compiled == "on")
    captured = _logits_along(engine, PROMPT, expected, decoder=step)
    if compiled == "on":
        run = step.compiled_step()
        direct = _logits_along(engine, PROMPT, expected, decoder=lambda token, position: run(
            token, torch.tensor([position], device=engine.device)))
        assert float((captured - direct).abs().max()) <= 1e-5 * float(direct.abs().max())
        cache = next(iter(engine.caches.values()))  # holds the prompt and the tokens after it
        parts, groups = cache.fused_parts(cache.slots), 2
        positions = torch.tensor([len(PROMPT) + len(expected) - 2], device=engine.device)

        def read(q):
            return kv_attention.quantized_attention(q, *parts["k"], *parts["v"], cache.pos, positions, parts["k_bits"],
                                                    parts["v_bits"], cache.head_dim ** -0.5, 0)

        q = torch.randn(1, cache.kv_heads, groups, cache.head_dim, device=engine.device)
        alone = read(q)
        # inductor's softmax may round a weight's last bit otherwise, which can move its float16
        # product by a rounding step (5e-4 of one term)
        assert float((torch.compile(read, fullgraph=True, dynamic=False)(q) - alone).abs().max()) <= \
            1e-3 * float(alone.abs().max())
        return
    eager = _logits_along(engine, PROMPT, expected)
    # The same logits up to rounding (a tiny random model's near-ties would turn on it), and the
    # same choice wherever the eager step's top two are further apart than that.
    worst = float((captured - eager).abs().max())
    assert worst <= 2e-2 * float(eager.abs().max()), (worst, float(eager.abs().max()),
                                                      (captured - eager).abs().amax(-1).tolist())
    top = eager.topk(2, dim=-1).values
    clear = (top[:, 0] - top[:, 1]) > 2 * worst
    assert torch.equal(captured.argmax(-1)[clear], eager.argmax(-1)[clear])


def _logits_along(engine, prompt, tokens, decoder=None):
    """Each step's logits [steps, vocab]: the prompt, then `tokens` fed one by one (through
    `decoder` when given), whatever the step would have chosen."""
    device = engine.device
    engine.reset()
    rows = []
    with torch.inference_mode():
        logits = engine.step(torch.tensor(prompt, device=device), torch.arange(len(prompt), device=device), len(prompt))
        rows.append(logits.reshape(-1).float().cpu())
        for position, token in enumerate(tokens[:-1], start=len(prompt)):
            token = torch.tensor([token], device=device)
            logits = decoder(token, position) if decoder is not None else \
                engine.step(token, torch.tensor([position], device=device), position + 1)
            rows.append(logits.reshape(-1).float().cpu())
    return torch.stack(rows)


def _compile_for_sm90(kernel, signature: dict, constexprs: dict, warps: int = 4) -> None:
    """Compiles a Triton kernel for an sm_90 GPU without one (Triton's front end, its passes and
    the ptxas it ships): what its interpreter never runs, such as the rules on constexprs."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    full = {**signature, **{name: "constexpr" for name in constexprs}}
    source = ASTSource(fn=kernel, signature=full,
                       constexprs={(names.index(name),): value for name, value in constexprs.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    assert compiled.asm.get("cubin"), f"{kernel.__name__} {constexprs}: no cubin"


def test_kv_kernels_compile_for_the_gpu():
    """The KV kernels of every engine mode (the read's two, the turbo modes' write) compile for the
    GPU (offline, here on the CPU) at the default tiles (the read's for long and short caches) and
    head dims 64, 256 and 512: a kernel the
    interpreter runs may still fail to compile (a reassigned constexpr once did), and only a GPU
    run would have told."""
    pytest.importorskip("triton", reason="Triton is not installed (it comes with torch's CUDA wheels)")
    import triton.language as tl

    from gemmactl.runtime.engine import kv_attention, kv_attention_kernel, kv_turn, kv_turn_kernel
    from gemmactl.runtime.engine.kv_modes import TURBO_BITS

    tile = kv_turn.DEFAULT_TILE
    write = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "kc_ptr": "*fp32", "vc_ptr": "*fp32",
             "sign_ptr": "*fp32", "h_ptr": "*fp16", "ke_ptr": "*fp32", "ve_ptr": "*fp32", "kcode_ptr": "*u8",
             "vcode_ptr": "*u8", "kscale_ptr": "*fp16", "vscale_ptr": "*fp16", "slot_ptr": "*i64",
             "at_ptr": "*i64", "pos_ptr": "*i64", "out_ptr": "*fp32", "rows": "i32", "heads": "i32",
             "kv_heads": "i32", "slots": "i32", "inv_root": "fp32"}
    scores = {"q_ptr": "*fp32", "kw_ptr": "*i32", "ks_ptr": "*fp16", "kl_ptr": "*fp32", "kpos_ptr": "*i64",
              "pos_ptr": "*i64", "s_ptr": "*fp32", "S": "i32", "kv_heads": "i32", "groups": "i32",
              "row_words": "i32", "query_scale": "fp32", "window": "i32"}
    values = {"w_ptr": "*fp32", "vw_ptr": "*i32", "vs_ptr": "*fp16", "vl_ptr": "*fp32", "out_ptr": "*fp32",
              "S": "i32", "kv_heads": "i32", "groups": "i32", "row_words": "i32", "per_share": "i32",
              "shares": "i32"}
    for mode, (k_bits, v_bits) in {"int8": (8, 8), **TURBO_BITS}.items():
        (k0, k1), (v0, v1) = code_planes(k_bits), code_planes(v_bits)
        for dim in (64, 256, 512):
            read = dict(D=dim, GROUPS=16, DOT=tl.float16)
            for tiles in (kv_attention.DEFAULT_READ_TILE, kv_attention.SHORT_READ_TILE):
                _compile_for_sm90(kv_attention_kernel.key_scores, scores,
                                  dict(read, W0=k0, W1=k1, BLOCK=tiles.score_block,
                                       CHUNK=min(tiles.score_chunk, dim)), tiles.warps)
                _compile_for_sm90(kv_attention_kernel.weighted_values, values,
                                  dict(read, W0=v0, W1=v1, BLOCK=tiles.value_block,
                                       CHUNK=min(tiles.value_chunk, dim)), tiles.warps)
            if mode == "int8":  # no rotation: the turn kernels are the turbo modes'
                continue
            shape = dict(D=dim, ROWS=kv_turn.ROWS, CHUNK=min(tile.chunk, dim), PART=min(tile.part, dim))
            _compile_for_sm90(kv_turn_kernel.turned_write, write,
                              dict(shape, KW0=k0, KW1=k1, VW0=v0, VW1=v1, K_EDGES=(1 << k_bits) - 1,
                                   V_EDGES=(1 << v_bits) - 1, STAGES=tile.stages), tile.warps)


def test_the_read_names_its_tiles_in_the_traced_graph(monkeypatch):
    """The read's tiles and the values' shares are arguments of its ops, so a traced step carries
    them as constants: a step compiled (and cached on disk) at other tiles, whose shares are another
    number and whose output another shape, is another graph, not taken for this one."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    from gemmactl.runtime.engine import kv_attention
    from gemmactl.runtime.engine.kv import make_cache

    cache = make_cache("tq4", 512, 2, 64, False, torch.float32, "cpu")
    cache.begin(torch.randn(512, 2, 64), torch.randn(512, 2, 64))
    parts = cache.fused_parts(512)

    def read(q, k_codes, k_scales, k_levels, v_codes, v_scales, v_levels, key_positions, positions):
        return kv_attention.quantized_attention(q, k_codes, k_scales, k_levels, v_codes, v_scales, v_levels,
                                                key_positions, positions, parts["k_bits"], parts["v_bits"], 0.125, 0)

    def traced(tile):
        if tile:
            monkeypatch.setenv(kv_attention.TILE_ENV, tile)
        else:
            monkeypatch.delenv(kv_attention.TILE_ENV, raising=False)
        kv_attention.read_tile.cache_clear()
        try:
            return make_fx(read, tracing_mode="fake")(torch.randn(1, 2, 4, 64), *parts["k"], *parts["v"], cache.pos,
                                                     torch.tensor([511])).code
        finally:
            kv_attention.read_tile.cache_clear()

    short, forced = traced(""), traced("32,128,32,128,4")
    assert str(list(kv_attention.SHORT_READ_TILE)) in short and "[32, 128, 32, 128, 4, 4]" in forced
    assert short != forced


def test_the_turned_write_takes_one_dtype():
    """The write's kernel takes a row's vector through one pointer of one type: queries, keys and
    values of different dtypes are refused before a launch, not compiled into a type error."""
    from gemmactl.runtime.engine import kv_turn

    pytest.importorskip("triton", reason="Triton is not installed (it comes with torch's CUDA wheels)")
    cache = make_cache("tq4", 8, 2, 64, False, torch.float32, "cpu", seed=1)
    cache.begin(torch.randn(2, 2, 64), torch.randn(2, 2, 64))
    q, k, v = torch.randn(1, 4, 64, dtype=torch.bfloat16), torch.randn(1, 2, 64), torch.randn(1, 2, 64)
    positions = torch.tensor([0])
    with pytest.raises(ValueError, match="one dtype"):
        kv_turn.turned_write(q, k, v, cache.centres["k"], cache.centres["v"], cache.signs, cache.edges["k"],
                             cache.edges["v"], cache.codes["k"], cache.scales["k"], cache.codes["v"],
                             cache.scales["v"], positions, positions, cache.pos, cache.bits["k"], cache.bits["v"])


def _forced_tile(monkeypatch, env: str, tile, value: str):
    """What the cached tile function `tile` gives with env set to value (cached anew before and after)."""
    monkeypatch.setenv(env, value)
    tile.cache_clear()
    try:
        return tile()
    finally:
        tile.cache_clear()


def test_the_write_tile_is_forced_or_refused(monkeypatch):
    """GEMMACTL_KV_TURN_TILE forces the write kernel's tile, its parts in flight optional; a value it
    cannot take is refused with what it takes."""
    from gemmactl.runtime.engine import kv_turn

    def forced(value):
        return _forced_tile(monkeypatch, kv_turn.TILE_ENV, kv_turn.tile, value)

    assert forced("") == kv_turn.DEFAULT_TILE
    assert forced("32,128,8") == kv_turn.Tile(32, 128, 8, kv_turn.DEFAULT_TILE.stages)
    assert forced("16,32,4,1").stages == 1
    for bad in ("8,64,4", "32,64,4,0", "32,48,4", "a,b"):
        with pytest.raises(ValueError, match="KV_TURN_TILE"):
            forced(bad)


def test_the_read_tile_is_forced_or_refused(monkeypatch):
    """GEMMACTL_KV_READ_TILE forces the fused read's tiles (a benchmark's sweep); a value the kernels
    cannot take is refused with what they take, before any launch."""
    from gemmactl.runtime.engine import kv_attention

    def forced(value):
        return _forced_tile(monkeypatch, kv_attention.TILE_ENV, kv_attention.read_tile, value)

    assert forced("") == kv_attention.DEFAULT_READ_TILE
    assert kv_attention.tile_for(512) == kv_attention.SHORT_READ_TILE  # a sliding window's
    assert kv_attention.tile_for(32768) == kv_attention.DEFAULT_READ_TILE
    assert forced("64,256,128,64,8") == kv_attention.ReadTile(64, 256, 128, 64, 8, kv_attention.PROGRAMS_PER_SM)
    assert forced("64,256,128,64,8,2").programs_per_sm == 2
    for bad in ("8,128,64,128,4", "32,16,64,128,4", "32,128,64,96,4", "32,128,64,128,3", "a,b", "32,128"):
        with pytest.raises(ValueError, match="KV_READ_TILE"):
            forced(bad)
