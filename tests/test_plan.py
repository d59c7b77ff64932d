"""gemmactl plan: size parser, solver properties, auto placement, JSON schema, CLI errors."""

from __future__ import annotations

import json
import os
import time

import pytest

from conftest import invoke
from gemmactl.errors import BudgetTooSmallError, InvalidOptionError
from gemmactl.machine import Gpu, Machine, process_gpu_peak
from gemmactl.plan.inventory import Inventory, LayerInventory
from gemmactl.plan.model_shape import ModelShape
from gemmactl.plan.profile import fastest_seconds, load_profile
from gemmactl.sizes import parse_size
from gemmactl.plan.solver import Budget, Placement, evaluate, kv_bytes, kv_cells, plan_placement

GiB, MiB = 1 << 30, 1 << 20


@pytest.mark.parametrize("text, expected", [
    ("4G", 4 * GiB), ("4GB", 4 * GiB), ("4GiB", 4 * GiB), ("4gib", 4 * GiB), ("4096M", 4 * GiB),
    ("3.5G", int(3.5 * GiB)), ("512MiB", 512 * MiB), ("1T", 1 << 40), ("2048", 2048), (" 8 G ", 8 * GiB),
])
def test_parse_size_accepts(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["0", "0G", "-4G", "-1", "four", "4X", "", "G", "4.5.1G", "1e9", "nan", "inf", "99999999999T"])
def test_parse_size_refuses(text):
    with pytest.raises(InvalidOptionError) as caught:
        parse_size(text, option="--vram")
    assert caught.value.exit_code == 2 and "--vram" in caught.value.message


def synthetic_moe(n_layers: int = 8, experts: int = 16, used: int = 2) -> Inventory:
    """An MoE inventory with round numbers: dense 40 MiB + experts 160 MiB per layer."""
    sliding = tuple((i + 1) % 4 != 0 for i in range(n_layers))
    shape = ModelShape("gemma4", n_layers, 1024, 262_144, 8, 2048, sliding, (2,) * n_layers, (256,) * n_layers,
                       (256,) * n_layers, 512, 32_768, n_experts=experts, experts_used=used, moe_intermediate=256)
    layers = []
    for i in range(n_layers):
        layer = LayerInventory(i, sliding[i], 2, 256, 256)
        layer.bytes.update(attention=10 * MiB, mlp=30 * MiB, experts=160 * MiB)
        layer.params.update(attention=20 * MiB, mlp=60 * MiB, experts=320 * MiB)
        layers.append(layer)
    inventory = Inventory("config", "synthetic", "Q4_K_M", shape, layers)
    inventory.globals.update(token_embd=200 * MiB, output_norm=4096)
    return inventory


def synthetic_dense(n_layers: int = 12) -> Inventory:
    inventory = synthetic_moe(n_layers)
    for layer in inventory.layers:
        layer.bytes["experts"] = 0
        layer.params["experts"] = 0
        layer.bytes["mlp"] = 90 * MiB
    inventory.shape = ModelShape(**{**inventory.shape.__dict__, "n_experts": 0, "experts_used": 0})
    return inventory


DESKTOP = load_profile("desktop-4g")


@pytest.mark.parametrize("make", [synthetic_moe, synthetic_dense])
def test_solver_never_exceeds_budget_and_more_vram_is_never_slower(make):
    inventory = make()
    previous = 0.0
    for vram_mib in range(1000, 4200, 100):
        budget = Budget(vram_mib * MiB, 32 * GiB)
        try:
            plan = plan_placement(inventory, DESKTOP, budget, context=4096)
        except BudgetTooSmallError:
            assert previous == 0.0, "a larger budget must not become infeasible"
            continue
        assert plan.gpu_bytes <= budget.vram_bytes and plan.cpu_bytes <= budget.ram_bytes
        assert plan.decode_tok_s >= previous - 1e-9
        previous = plan.decode_tok_s
    assert previous > 0


def test_moe_experts_leave_the_gpu_before_layers():
    inventory = synthetic_moe()
    whole = evaluate(inventory, DESKTOP, Budget(64 * GiB, 64 * GiB), Placement(inventory.shape.n_layers + 1), 4096, 1)
    plan = plan_placement(inventory, DESKTOP, Budget(int(whole.gpu_bytes * 0.6), 32 * GiB), context=4096)
    assert plan.placement.cpu_expert_layers, "some experts must have moved to RAM"
    on_cpu = [layer for layer in plan.layers if layer.device == "cpu"]
    if on_cpu:  # a whole layer leaves only once every GPU layer's experts already have
        assert all(layer.experts_device == "cpu" for layer in plan.layers)
    dense_gpu = sum(1 for layer in plan.layers if layer.device == "gpu")
    assert dense_gpu == inventory.shape.n_layers


def test_budget_too_small_names_the_minimum():
    inventory = synthetic_dense()
    with pytest.raises(BudgetTooSmallError) as caught:
        plan_placement(inventory, DESKTOP, Budget(50 * MiB, 32 * GiB), context=4096)
    assert "smallest needs" in caught.value.message and "--vram" in caught.value.hint
    with pytest.raises(BudgetTooSmallError) as caught:
        plan_placement(inventory, DESKTOP, Budget(4 * GiB, 100 * MiB), context=4096)
    assert "RAM" in caught.value.message and "--ram" in caught.value.hint


def test_kv_cells_sliding_window_and_shared_layers():
    shape = synthetic_moe().shape
    full = LayerInventory(3, False, 2, 512, 512)
    sliding = LayerInventory(0, True, 2, 256, 256)
    shared = LayerInventory(7, False, 0, 512, 512)
    assert kv_cells(full, shape, 8192, 1) == 8192
    assert kv_cells(full, shape, 8000, 1) == 8192  # padded to 256 cells
    assert kv_cells(sliding, shape, 8192, 1) == 1024  # window 512 + one micro-batch of 512
    assert kv_cells(sliding, shape, 300, 1) == 512  # never more than the context
    assert kv_cells(sliding, shape, 8192, 4) == 2560  # a window per sequence
    assert kv_cells(shared, shape, 8192, 1) == 0
    assert kv_bytes(full, 8192) == 8192 * 2 * (512 + 512) * 2


def fake_machine(memory=4 * GiB):
    return Machine("test cpu", 2, [], 32 * GiB, "x86_64", gpus=[Gpu(0, "Fake GPU", memory, "1", "7.5")])


@pytest.mark.real_model
def test_auto_placement_with_a_fake_gpu(embedded_gguf, isolated_home):
    from gemmactl.plan.auto import auto_placement

    roomy = auto_placement(embedded_gguf, 4096, machine=fake_machine(), gpu_capable=True, free_vram=4 * GiB)
    assert not roomy.applied and roomy.n_gpu_layers == -1 and "fits the GPU whole" in roomy.reason
    tight = auto_placement(embedded_gguf, 4096, machine=fake_machine(), gpu_capable=True, free_vram=1000 * MiB)
    assert tight.applied and 0 <= tight.n_gpu_layers < 19 and tight.server_args[:2] == ("-ngl", str(tight.n_gpu_layers))
    assert tight.reason.startswith("plan: ") and "of 1000.0 MiB free" in tight.reason
    none = auto_placement(embedded_gguf, 4096, machine=Machine("cpu", 2, [], GiB, "x86_64"))
    assert not none.applied and none.n_gpu_layers == 0 and "no NVIDIA GPU" in none.reason
    no_cuda = auto_placement(embedded_gguf, 4096, machine=fake_machine(), gpu_capable=False)
    assert not no_cuda.applied and no_cuda.n_gpu_layers == 0 and "no CUDA backend" in no_cuda.reason
    tiny = auto_placement(embedded_gguf, 4096, machine=fake_machine(), gpu_capable=True, free_vram=10 * MiB)
    assert not tiny.applied and tiny.n_gpu_layers == 0 and "not even one layer" in tiny.reason


REQUIRED_KEYS = [
    ("budget", "vram_bytes"), ("budget", "ram_bytes"), ("totals", "gpu_bytes"), ("totals", "cpu_bytes"),
    ("predicted", "decode_tok_s"), ("predicted", "ttft_s"), ("llama_cpp_args", "-ngl"), ("llama_cpp_args", "-ot"),
    ("llama_cpp_args", "--n-cpu-moe"), ("llama_cpp_args", "-c"), ("llama_cpp_args", "-ctk"), ("llama_cpp_args", "-ctv"),
]


@pytest.mark.real_model
def test_plan_json_schema_and_out_file(runner, model_home, tmp_path):
    result = invoke(runner, ["plan", "embedded", "--vram", "1G", "--ram", "8G", "--context", "4096", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    for section, key in REQUIRED_KEYS:
        assert key in data[section], (section, key)
    assert data["budget"] == {"vram_bytes": GiB, "ram_bytes": 8 * GiB}
    assert data["totals"]["gpu_bytes"] <= GiB
    assert len(data["layers"]) == 18 and {"index", "device", "bytes"} <= set(data["layers"][0])
    assert {"attention", "mlp", "experts", "per_layer", "kv"} == set(data["layers"][0]["bytes"])
    gpu_layers = [layer["index"] for layer in data["layers"] if layer["device"] == "gpu"]
    assert gpu_layers == list(range(18 - len(gpu_layers), 18))  # llama.cpp offloads the last layers
    assert data["llama_cpp_args"]["-ngl"] == len(gpu_layers) + 1
    assert data["device_map"]["model.layers.17"] == ("cuda:0" if 17 in gpu_layers else "cpu")
    assert any("no NVIDIA GPU" in note for note in data["notes"])
    out = tmp_path / "plan.json"
    result = invoke(runner, ["plan", "embedded", "--vram", "1G", "--ram", "8G", "--context", "4096", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text()) == data
    assert "predicted: decode" in result.stdout and "layer" in result.stdout


@pytest.mark.real_model
@pytest.mark.parametrize("args, words, code", [
    (["--vram", "0"], "more than zero", 2),
    (["--vram", "-4G"], "more than zero", 2),
    (["--vram", "lots"], "not a size", 2),
    (["--vram", "9999999999T"], "too large", 2),
    (["--vram", "4G", "--context", "40000"], "maximum of 32768", 2),
    (["--vram", "100M"], "smallest needs", 2),
    (["--vram", "4G", "--quant", "Q4_K_M"], "already a gguf", 2),
    (["--hardware", "laptop"], "unknown hardware profile", 2),
])
def test_plan_bad_input(runner, model_home, args, words, code):
    result = invoke(runner, ["plan", "embedded", *args])
    assert result.exit_code == code, result.output
    assert words in result.stderr and result.stderr.startswith("Error: ") and "Traceback" not in result.stderr


def test_plan_unknown_architecture(runner, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    result = invoke(runner, ["plan", str(tmp_path), "--quant", "Q4_K_M", "--vram", "4G"])
    assert result.exit_code == 2 and "unknown architecture 'llama'" in result.stderr


@pytest.mark.real_model
def test_hardware_profile_and_warning_over_the_gpu(runner, model_home):
    result = invoke(runner, ["plan", "embedded", "--hardware", "desktop-4g", "--vram", "6G", "--json"])
    assert result.exit_code == 0, result.output
    assert "more than the 4.0 GiB the GPU has" in result.stderr
    assert json.loads(result.stdout)["hardware"]["name"] == "desktop-4g"
    spark = json.loads(invoke(runner, ["plan", "embedded", "--hardware", "dgx-spark", "--json"]).stdout)
    assert spark["hardware"]["unified_memory"] and spark["llama_cpp_args"]["-ngl"] == 19


@pytest.mark.real_model
def test_auto_parallel_slots_follow_the_memory(embedded_gguf, isolated_home):
    """`parallel: auto`: as many slots as keep the whole model on the GPU (or, without one, in RAM)."""
    from gemmactl.plan.auto import AUTO_PARALLEL_MAX, auto_parallel

    roomy, why = auto_parallel(embedded_gguf, 4096, machine=fake_machine(), gpu_capable=True, free_vram=8 * GiB)
    assert roomy == AUTO_PARALLEL_MAX and "fit the 8.0 GiB free on the GPU" in why
    counts = [auto_parallel(embedded_gguf, 8192, machine=fake_machine(), gpu_capable=True, free_vram=v * MiB)[0]
              for v in (900, 1100, 1400, 2000)]
    assert counts == sorted(counts) and counts[0] < counts[-1]  # more VRAM never gives fewer slots
    small, _ = auto_parallel(embedded_gguf, 8192, machine=fake_machine(), gpu_capable=True, free_vram=1100 * MiB)
    assert small < AUTO_PARALLEL_MAX
    cramped, why = auto_parallel(embedded_gguf, 4096, machine=fake_machine(), gpu_capable=True, free_vram=10 * MiB)
    assert cramped == 1 and "does not fit" in why
    cpu, why = auto_parallel(embedded_gguf, 4096, machine=Machine("cpu", 2, [], 32 * GiB, "x86_64"))
    assert cpu == AUTO_PARALLEL_MAX and "of RAM" in why
    tight_ram, _ = auto_parallel(embedded_gguf, 32768, machine=Machine("cpu", 2, [], 2 * GiB, "x86_64"))
    assert 1 <= tight_ram < AUTO_PARALLEL_MAX


@pytest.mark.real_model
def test_auto_parallel_sizes_slots_for_the_tiers_kv_cache_type(embedded_gguf, isolated_home):
    """A tier with a quantized KV cache (q8_0, q4_0) fits more slots in the same VRAM than f16,
    each count being the most whose caches (at that type's bytes) still let the model fit whole."""
    from gemmactl.plan.auto import auto_parallel

    def slots(kv_cache, vram=1100 * MiB):
        return auto_parallel(embedded_gguf, 8192, machine=fake_machine(), gpu_capable=True, free_vram=vram,
                             kv_cache=kv_cache)[0]

    f16, q8, q4 = slots(None), slots("q8_0"), slots("q4_0")
    assert f16 == slots("f16") and f16 < q8 <= q4


def test_the_profile_keeps_the_fastest_round_not_one_slowed_by_other_work():
    ticks = iter([0.0, 1.0, 1.0, 9.0, 9.0, 9.5, 9.5, 12.0])  # rounds of 1, 8 (the cores shared), 0.5, 2.5
    calls = []
    assert fastest_seconds(lambda: calls.append(1), 4, clock=lambda: next(ticks)) == 0.5
    assert len(calls) == 4


def test_the_gpu_memory_peak_comes_from_one_looping_nvidia_smi_and_counts_this_process_only(tmp_path, monkeypatch):
    """An nvidia-smi of our own on PATH: it must be started once with --loop-ms and looping, not once a
    sample, and it is stopped when the measured work ends."""
    log = tmp_path / "calls"
    fake = tmp_path / "nvidia-smi"
    fake.write_text(f"""#!/bin/sh
echo "$*" >> {log}
echo "1, GPU-a, 9000"
echo "{os.getpid()}, GPU-a, 300"
echo "{os.getpid()}, GPU-a, 500"
echo "{os.getpid()}, GPU-b, 200"
echo "{os.getpid()}, GPU-a, 400"
while :; do sleep 0.05; echo "{os.getpid()}, GPU-a, 100"; done
""")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with process_gpu_peak() as watch:
        deadline = time.monotonic() + 10
        while watch.peak < 700 << 20 and time.monotonic() < deadline:
            time.sleep(0.02)
    assert watch.peak == 700 << 20  # 500 + 200 on two GPUs at once; the other process's 9,000 MiB is not ours
    calls = log.read_text().splitlines()
    assert len(calls) == 1 and "--loop-ms=50" in calls[0] and "--query-compute-apps=pid,gpu_uuid,used_memory" in calls[0]
    assert watch._proc.poll() is not None  # stopped with the work
