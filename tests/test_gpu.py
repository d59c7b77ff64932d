"""The GPU tier (`pytest -m gpu`): what only a CUDA machine can show. Skipped without one (one
line in the summary says so); `bash benchmarks/gpu_tests.sh` runs it there. Models are tiny random
Gemma 4s with the real Gemma 4 tokenizer: the GPU machine has no embedded model package.

- the llama.cpp build the tests make is a CUDA build, and doctor's proof ran every layer of a
  model on the GPU;
- a tier capped below the model's size gets the plan's partial offload, with the same greedy
  text as the whole model on the GPU;
- the int4 engine under a capped budget: the plan's placement (layers streamed or on the CPU)
  gives the all-resident engine's greedy tokens, within the memory the plan said.
(The engine's kernels and captured step on CUDA are in tests/test_engine.py, marked the same way.)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_gemmactl

pytestmark = pytest.mark.gpu
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def gpu_gguf(llama_build_store, tiny_checkpoint, tmp_path_factory):
    """A Q8_0 GGUF of a tiny random Gemma 4 (the GPU machine has no embedded model package), in a
    store that shares the tests' llama.cpp build (a CUDA build on a machine with nvcc and a GPU)."""
    home = tmp_path_factory.mktemp("gpu-home")
    for sub in ("builds", "sources"):
        (home / sub).symlink_to(llama_build_store / sub, target_is_directory=True)
    proc = run_gemmactl(["quantize", str(tiny_checkpoint("dense-ple")), "--gguf", "Q8_0", "--json"],
                        env={"GEMMACTL_HOME": str(home)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return home, Path(json.loads(proc.stdout)["path"])


def test_the_build_is_cuda_and_every_layer_runs_on_the_gpu(gpu_gguf):
    home, gguf = gpu_gguf
    proc = run_gemmactl(["doctor", "--model", str(gguf), "--json"], env={"GEMMACTL_HOME": str(home)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["build"]["backend"] == "cuda" and report["machine"]["gpus"]
    proof = report["proof"]
    assert proof["layers_total"] and proof["layers_offloaded"] == proof["layers_total"], proof["log_tail"]
    assert any(device.startswith("CUDA") for device in proof["model_buffers_mib"]), proof
    assert not report["warnings"]


def _run(home, recipe, tier: str) -> dict:
    proc = run_gemmactl(["run", "--recipe", str(recipe), "--tier", tier, "--raw", "--json", "--stats",
                         "--max-tokens", "24", PROMPT], env={"GEMMACTL_HOME": str(home)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return {"answer": json.loads(proc.stdout)["answer"], "stderr": proc.stderr}


def test_a_capped_tier_offloads_part_of_the_model_and_answers_the_same(gpu_gguf, tmp_path, monkeypatch):
    """A budget that leaves out half the layers splits the model (-ngl below the layer count) and
    answers; split that way, the model's next-token distributions are the whole model's on the GPU
    (llama-perplexity's KL divergence, over a text). Not greedy text, nor top-1 agreement: this
    random model is near-uniform over its 262,144 tokens (perplexity about the vocabulary's size),
    so its top tokens are ties that any rounding moves (the CPU's and GPU's moved the 24-token text
    on the H200). On the CPU the same KL is 0 for the same Q8_0 and 0.0126 against its Q4_0: the
    bound is a tenth of that."""
    from gemmactl.plan.report import build_plan
    from gemmactl.store import Store

    home, gguf = gpu_gguf
    monkeypatch.setenv("GEMMACTL_HOME", str(home))
    whole = build_plan(str(gguf), vram="64G", context=2048, store=Store(home))
    # Half the layers no longer fit. (Not half the weights: most of a tiny model's weights are its
    # output matrix, and without it on the GPU no layer goes there.)
    layers = sum(sum(size for part, size in layer.bytes.items() if part != "kv") + layer.kv_bytes
                 for layer in whole.plan.layers)
    cap = whole.plan.gpu_bytes - layers // 2
    capped = build_plan(str(gguf), vram=f"{cap}B", context=2048, store=Store(home))
    on_gpu = sum(1 for layer in capped.plan.layers if layer.device == "gpu")
    assert 0 < on_gpu < capped.plan.inventory.shape.n_layers
    recipe = tmp_path / "capped.yaml"
    recipe.write_text(
        "tiers:\n"
        f"  whole:\n    model: {gguf}\n    context: 2048\n    sampling: {{temperature: 0.0}}\n"
        f"  capped:\n    model: {gguf}\n    context: 2048\n    vram: {cap}B\n    sampling: {{temperature: 0.0}}\n"
    )
    full, part = _run(home, recipe, "whole"), _run(home, recipe, "capped")
    ngl = re.search(r"placement:.*-ngl (\d+)", part["stderr"])
    assert ngl and 0 < int(ngl[1]) <= capped.plan.inventory.shape.n_layers, part["stderr"][-2000:]
    assert full["answer"] and part["answer"]
    kld = _kl_divergence(home, gguf, int(ngl[1]), tmp_path)
    assert kld["kld_mean"] <= KLD_BOUND, kld


KLD_BOUND = 0.00126  # a tenth of the tiny model's Q8_0 → Q4_0 divergence (measured on the CPU)
TEXT = ("The river runs past the old mill and under the stone bridge, where children throw sticks "
        "and watch them float away toward the sea. ") * 30


def _kl_divergence(home, gguf, ngl: int, tmp_path) -> dict:
    """llama-perplexity's mean KL divergence and same-top share: every layer on the GPU (the
    base), against ngl layers on it."""
    from gemmactl.llamacpp.build import active_build
    from gemmactl.store import Store

    binary = active_build(Store(home)).binary("llama-perplexity")
    text, base = tmp_path / "text.txt", tmp_path / "base.kld"
    text.write_text(TEXT)
    common = [str(binary), "-m", str(gguf), "-f", str(text), "-c", "128", "--chunks", "2",
              "--kl-divergence-base", str(base)]
    for args in (["-ngl", "999"], ["-ngl", str(ngl), "--kl-divergence"]):
        proc = subprocess.run(common + args, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
    log = proc.stdout + proc.stderr
    found = {"kld_mean": re.search(r"Mean\s+KLD:\s*([-\d.]+)", log), "same_top": re.search(r"Same top p:\s*([\d.]+)", log)}
    assert all(found.values()), log[-2000:]
    return {key: float(match.group(1)) for key, match in found.items()}


def _artifact(tiny_checkpoint, folder):
    from gemmactl.formats.int4.layout import QuantizeOptions
    from gemmactl.formats.int4.quantize import quantize_checkpoint

    quantize_checkpoint(tiny_checkpoint("dense-ple"), folder, QuantizeOptions(group_size=32, shard_size=1 << 30))
    return folder


def test_the_engine_under_a_capped_budget_decodes_like_the_resident_one(tiny_checkpoint, tmp_path):
    """A budget at the engine's minimum: no layer resident, tables in host memory. Same greedy
    tokens as every layer resident, and the GPU memory it allocated stays within the plan's."""
    import torch

    from gemmactl.formats.int4.reader import open_artifact
    from gemmactl.plan.engine_map import plan_engine
    from gemmactl.plan.profile import load_profile
    from gemmactl.runtime.engine.model import GemmaModel
    from gemmactl.runtime.engine.placement import EnginePlacement
    from test_engine import PROMPT as TOKENS, engine_greedy

    folder = _artifact(tiny_checkpoint, tmp_path / "artifact")
    profile = load_profile("desktop-4g")
    minimum = plan_engine(folder, profile, 64 << 30, 256).minimum_vram_bytes
    chosen = plan_engine(folder, profile, minimum, 256)
    assert "resident" not in chosen.layers and chosen.tables_on_host
    artifact = open_artifact(folder)
    resident = GemmaModel(artifact, device="cuda", dtype=torch.bfloat16, context=256)
    expected, _ = engine_greedy(resident, TOKENS, 16, chunk=5)
    del resident
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    placed = GemmaModel(artifact, device="cuda", dtype=torch.bfloat16, context=256,
                        placement=EnginePlacement(chosen.layers, chosen.tables_on_host, chosen.reason))
    tokens, _ = engine_greedy(placed, TOKENS, 16, chunk=5)
    assert tokens == expected
    allocated = torch.cuda.max_memory_allocated() - before
    planned = chosen.gpu_total - chosen.gpu_bytes["reserve"]  # the CUDA context is not torch's to count
    assert allocated <= planned, (allocated, chosen.gpu_bytes)


def test_run_on_the_int4_engine_uses_the_gpu(tiny_checkpoint, tmp_path):
    """`run` on an int4-stream artifact on CUDA: the engine with int4 kernels and a captured step."""
    folder = _artifact(tiny_checkpoint, tmp_path / "art")
    proc = subprocess.run([sys.executable, "-m", "gemmactl", "run", "--model", str(folder), "--raw", "--json",
                           "--temperature", "0", "--max-tokens", "8", PROMPT],
                          capture_output=True, text=True, env={**os.environ, "GEMMACTL_HOME": str(tmp_path / "home")})
    assert proc.returncode == 0, proc.stderr[-2000:]
    engine = json.loads(proc.stdout)["model"]["engine"]
    assert engine["device"].startswith("cuda") and "int4-tinygemm" in engine["kernels"] and engine["cuda_graph"]


def test_plan_verify_holds_the_engine_to_its_budget(tiny_checkpoint, tmp_path):
    """`plan --backend int4 --vram CAP --verify` on CUDA, CAP the least the engine's map works in
    with this machine's profile (its measured CUDA context as the reserve): the engine loads the
    plan's map (every layer streamed), decodes, and its peak GPU memory as nvidia-smi sees it, the
    context included, stays inside the budget."""
    from gemmactl.machine import detect_machine
    from gemmactl.plan.engine_map import plan_engine
    from gemmactl.plan.profile import machine_profile

    folder = _artifact(tiny_checkpoint, tmp_path / "artifact")
    home = tmp_path / "home"
    profile, _ = machine_profile(home / "plan", detect_machine())  # cached there for the plan below
    minimum = plan_engine(folder, profile, 64 << 30, 256).minimum_vram_bytes
    proc = subprocess.run([sys.executable, "-m", "gemmactl", "plan", str(folder), "--backend", "int4", "--vram",
                           f"{minimum}B", "--context", "256", "--verify", "--json"],
                          capture_output=True, text=True, env={**os.environ, "GEMMACTL_HOME": str(home)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    verify = json.loads(proc.stdout)["verify"]
    assert verify["placement"] == "plan" and verify["engine_layers"]["resident"] == 0
    assert verify["decode_tokens"] >= 1 and verify["measured_decode_tok_s"] > 0
    assert 0 < verify["peak_gpu_bytes"] <= verify["budget_vram_bytes"] and verify["within_budget"]
