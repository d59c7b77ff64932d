"""The plan used, not just printed: `run` applies it on a GPU it does not fit; `plan --verify` decodes with it."""

from __future__ import annotations

import json

import pytest

from conftest import invoke
from gemmactl.machine import Gpu, Machine

MiB = 1 << 20


@pytest.mark.real_model
def test_run_applies_the_plan_when_the_model_does_not_fit(runner, model_home, monkeypatch):
    """A budget that holds the output layer and exactly GPU_LAYERS decoder layers: run loads that split."""
    from dataclasses import replace

    import gemmactl.plan.auto as auto
    from gemmactl.plan.inventory import inventory_from_gguf
    from gemmactl.plan.profile import DEFAULT_PROFILE, load_profile
    from gemmactl.plan.solver import Budget, Placement, evaluate
    from gemmactl.recipes import resolve_recipe
    from gemmactl.runtime.llamacpp import LlamaCppBackend

    gpu_layers = 9  # decoder layers the budget holds beside the output layer: -ngl 10
    gpu_machine = Machine("test cpu", 2, [], 32 << 30, "x86_64", gpus=[Gpu(0, "Fake 2 GB", 2048 * MiB, "1", "7.5")])
    inventory = inventory_from_gguf(model_home / "models/gemma3-270m/gemma-3-270m-q4_k_m.gguf")
    context = resolve_recipe("default").tier("fast").context  # the tier "quick:" routes to
    profile = replace(load_profile(DEFAULT_PROFILE), vram_bytes=gpu_machine.gpus[0].memory_bytes,
                      ram_bytes=gpu_machine.ram_bytes)

    def gpu_bytes(ngl: int) -> int:
        return evaluate(inventory, profile, Budget(1 << 40, 1 << 40), Placement(ngl), context, 1).gpu_bytes

    # Halfway between what -ngl 10 and -ngl 11 need on the GPU: the first fits, the next does not.
    free = (gpu_bytes(gpu_layers + 1) + gpu_bytes(gpu_layers + 2)) // 2
    assert gpu_bytes(gpu_layers + 1) < free < gpu_bytes(inventory.shape.n_layers + 1)  # and the whole model does not
    monkeypatch.setattr(auto, "detect_machine", lambda: gpu_machine)
    monkeypatch.setattr(auto, "gpu_capable_library", lambda store=None: True)
    monkeypatch.setattr("gemmactl.plan.profile.gpu_free_bytes", lambda index=0: free)
    seen = {}
    original = LlamaCppBackend.__init__

    def recording_init(self, model_path, **kwargs):
        seen.update(kwargs)
        # The CPU-only library here cannot offload: load on the CPU, keep the overrides.
        original(self, model_path, **{**kwargs, "n_gpu_layers": 0})

    monkeypatch.setattr(LlamaCppBackend, "__init__", recording_init)
    result = invoke(runner, ["run", "--model", "embedded", "--max-tokens", "4", "--stats", "quick: What is the capital of France?"])
    assert result.exit_code == 0, result.output
    assert seen["n_gpu_layers"] == gpu_layers + 1
    assert seen["tensor_overrides"] == ()  # a dense model: no expert overrides
    assert seen["extra_args"] == {"swa_full": False}
    assert f"placement: plan: {gpu_layers}/{inventory.shape.n_layers} layers and the output layer on GPU (" in result.stderr


@pytest.mark.real_model
def test_serve_and_bench_place_the_model_as_run_does(runner, model_home, monkeypatch):
    """One road: on a GPU the model does not fit, serve's in-process tier and bench load what run loads."""
    import gemmactl.plan.auto as auto
    from gemmactl.recipes import parse_recipe
    from gemmactl.runtime.llamacpp import LlamaCppBackend
    from gemmactl.server.service import ServeConfig, Service
    from gemmactl.store import Store

    gpu_machine = Machine("test cpu", 2, [], 32 << 30, "x86_64", gpus=[Gpu(0, "Fake 1 GB", 1024 * MiB, "1", "7.5")])
    monkeypatch.setattr(auto, "detect_machine", lambda: gpu_machine)
    monkeypatch.setattr(auto, "gpu_capable_library", lambda store=None: True)
    monkeypatch.setattr("gemmactl.plan.profile.gpu_free_bytes", lambda index=0: 1000 * MiB)
    loads = []
    original = LlamaCppBackend.__init__

    def recording_init(self, model_path, **kwargs):
        loads.append({key: kwargs.get(key) for key in ("n_gpu_layers", "tensor_overrides", "extra_args")})
        original(self, model_path, **{**kwargs, "n_gpu_layers": 0})  # this CPU-only library cannot offload

    monkeypatch.setattr(LlamaCppBackend, "__init__", recording_init)
    assert invoke(runner, ["run", "--max-tokens", "2", "quick: hi"]).exit_code == 0
    service = Service(ServeConfig(parse_recipe("tiers:\n  fast:\n    model: embedded\n"), port=0), Store(model_home))
    service.start()
    try:
        placement = service.lanes["fast"].snapshot()["placement"]
    finally:
        service.close()
    bench = invoke(runner, ["bench", "--prompts", "short", "--max-tokens", "2", "--repeat", "1", "--json"])
    assert bench.exit_code == 0, bench.output
    ran, served, benched = loads[0], loads[1], loads[-1]
    assert 0 < ran["n_gpu_layers"] < 18 and ran["extra_args"] == {"swa_full": False}  # a real split
    assert served == ran and benched == ran
    assert placement.startswith("in process; plan:")
    assert json.loads(bench.stdout)["manifest"]["settings"]["placement"].startswith("plan:")


@pytest.mark.real_model
def test_run_leaves_a_cpu_machine_alone(runner, model_home, monkeypatch):
    import gemmactl.plan.auto as auto
    from gemmactl.runtime.llamacpp import LlamaCppBackend

    monkeypatch.setattr(auto, "detect_machine", lambda: Machine("cpu", 2, [], 8 << 30, "x86_64"))
    seen = {}
    original = LlamaCppBackend.__init__

    def recording_init(self, model_path, **kwargs):
        seen.update(kwargs)
        original(self, model_path, **kwargs)

    monkeypatch.setattr(LlamaCppBackend, "__init__", recording_init)
    result = invoke(runner, ["run", "--model", "embedded", "--max-tokens", "2", "--stats", "quick: hi"])
    assert result.exit_code == 0, result.output
    assert "n_gpu_layers" not in seen and "placement:" not in result.stderr


@pytest.mark.real_model
def test_in_process_tensor_overrides_reach_llama_cpp(embedded_gguf):
    import llama_cpp

    from gemmactl.runtime.llamacpp import LlamaCppBackend, capture_llama_logs

    logs = capture_llama_logs(llama_cpp)
    logs.clear()
    backend = LlamaCppBackend(str(embedded_gguf), context_size=256, n_gpu_layers=0, tensor_overrides=(r"blk\.(2|3)\.ffn_up.*=CPU",))
    try:
        overridden = sorted(line.split()[1] for line in logs if "buffer type overridden to CPU" in line)
    finally:
        backend.close()
    assert overridden == ["blk.2.ffn_up.weight", "blk.3.ffn_up.weight"]


@pytest.mark.real_model
def test_plan_verify_on_the_embedded_model(runner, model_home):
    result = invoke(runner, ["plan", "embedded", "--vram", "1G", "--context", "2048", "--verify", "--json"])
    assert result.exit_code == 0, result.output
    verify = json.loads(result.stdout)["verify"]
    assert verify["placement"].startswith("cpu") and verify["n_gpu_layers"] == 0
    assert verify["decode_tokens"] > 10 and verify["measured_decode_tok_s"] > 0 and verify["predicted_decode_tok_s"] > 0
    assert verify["peak_gpu_bytes"] == 0 and verify["within_budget"]
    assert verify["ratio"] == pytest.approx(verify["measured_decode_tok_s"] / verify["predicted_decode_tok_s"], abs=1e-3)  # the ratio is kept to 3 decimals
