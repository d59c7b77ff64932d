"""`gemmactl build` and `gemmactl doctor`: planning (fast, table-driven) and a real CPU build (cached)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from conftest import invoke, run_gemmactl
from gemmactl.errors import InvalidOptionError, ToolchainMissingError
from gemmactl.llamacpp.build import cpu_flags, plan_build
from gemmactl.llamacpp.source import SourceTree
from gemmactl.machine import Gpu, Machine
from gemmactl.store import Store

SOURCE = SourceTree(path=Path("/src/llama.cpp"), version="llama-cpp-python 0.3.36 sdist", commit="sdist-sha256:ab", bindings_version="0.3.36")
H200 = Gpu(0, "NVIDIA H200", 141 * 2**30, "580.1", "9.0")


def machine(gpus=(), cuda="13.0", flags=("avx", "avx2", "fma", "f16c", "avx512f", "amx_int8", "amx_tile")) -> Machine:
    return Machine("Test CPU", 16, list(flags), 64 * 2**30, "x86_64", list(gpus), cuda)


def fake_tools(tmp_path, monkeypatch, names=("cmake", "ninja", "c++", "nvcc")):
    """A PATH holding only the named programs (as no-op scripts)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in names:
        tool = bin_dir / name
        tool.write_text("#!/bin/sh\nexit 0\n")
        tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", str(bin_dir))


def test_auto_picks_cuda_for_the_gpus_own_arch(tmp_path, monkeypatch):
    fake_tools(tmp_path, monkeypatch)
    plan = plan_build(Store(tmp_path), SOURCE, machine([H200]))
    assert plan.backend == "cuda" and plan.gpu_archs == ["90"]
    assert "-DGGML_CUDA=ON" in plan.cmake_flags and "-DCMAKE_CUDA_ARCHITECTURES=90" in plan.cmake_flags
    assert plan.generator == "Ninja"


def test_auto_without_a_gpu_is_an_optimized_cpu_build_without_amx(tmp_path, monkeypatch):
    fake_tools(tmp_path, monkeypatch)
    plan = plan_build(Store(tmp_path), SOURCE, machine())
    assert plan.backend == "cpu" and plan.gpu_archs == []
    assert "-DGGML_AVX512=ON" in plan.cmake_flags and "-DGGML_AVX512_BF16=OFF" in plan.cmake_flags
    assert "-DGGML_AMX_INT8=OFF" in plan.cmake_flags and "-DGGML_NATIVE=OFF" in plan.cmake_flags
    assert "-DLLAMA_USE_PREBUILT_UI=OFF" in plan.cmake_flags  # nothing may download during a build


def test_non_x86_uses_native():
    arm = Machine("Arm CPU", 20, ["asimd", "sve"], 128 * 2**30, "aarch64")
    assert cpu_flags(arm) == ["-DGGML_NATIVE=ON"]


def test_build_id_is_stable_and_changes_with_what_is_built(tmp_path, monkeypatch):
    fake_tools(tmp_path, monkeypatch)
    store = Store(tmp_path)
    a = plan_build(store, SOURCE, machine()).build_id
    assert a == plan_build(store, SOURCE, machine()).build_id
    assert a != plan_build(store, SOURCE, machine(flags=("avx", "avx2"))).build_id
    assert a != plan_build(store, SOURCE, machine([H200])).build_id
    other = SourceTree(SOURCE.path, SOURCE.version, "sdist-sha256:cd", "0.3.36")
    assert a != plan_build(store, other, machine()).build_id


def test_cuda_without_a_gpu_is_refused_unless_an_arch_is_given(tmp_path, monkeypatch):
    fake_tools(tmp_path, monkeypatch)
    with pytest.raises(InvalidOptionError, match="no NVIDIA GPU"):
        plan_build(Store(tmp_path), SOURCE, machine(), backend="cuda")
    plan = plan_build(Store(tmp_path), SOURCE, machine(), backend="cuda", cuda_arch="89")
    assert plan.gpu_archs == ["89"]


@pytest.mark.parametrize(
    "tools, backend, missing",
    [
        (("ninja", "c++"), "cpu", "cmake"),
        (("cmake", "ninja"), "cpu", r"C\+\+ compiler"),
        (("cmake", "ninja", "c++"), "cuda", "nvcc"),
        (("cmake", "ninja", "c++"), "vulkan", "glslc"),
    ],
)
def test_missing_tools_are_named_with_the_package_to_install(tmp_path, monkeypatch, tools, backend, missing):
    fake_tools(tmp_path, monkeypatch, tools)
    with pytest.raises(ToolchainMissingError, match=missing) as error:
        plan_build(Store(tmp_path), SOURCE, machine([H200]), backend=backend)
    assert "install" in error.value.hint.lower()


def test_source_that_is_not_llama_cpp_is_exit_2(tmp_path, runner):
    (tmp_path / "src").mkdir()
    result = invoke(runner, ["build", "--source", str(tmp_path / "src")])
    assert result.exit_code == 2
    assert "is not a llama.cpp source tree" in result.stderr and result.stderr.count("\n") == 1


def test_cuda_backend_on_a_machine_without_gpu_is_exit_2_before_any_work(runner, isolated_home):
    from gemmactl.machine import nvidia_gpus

    if nvidia_gpus():
        pytest.skip("this machine has a GPU")
    result = invoke(runner, ["build", "--backend", "cuda"])
    assert result.exit_code == 2
    assert ("no NVIDIA GPU" in result.stderr or "nvcc" in result.stderr) and result.stderr.count("\n") == 1
    assert not isolated_home.exists()  # nothing fetched, nothing written


# -- the real build (CPU, cached per machine by build id) ----------------------------------------


def test_real_build_manifest_and_repeat_is_a_no_op(llama_build_store):
    proc = run_gemmactl(["build", "--json"], env={"GEMMACTL_HOME": str(llama_build_store)})
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads(proc.stdout)
    assert manifest["built"] is False  # the fixture built it already
    assert manifest["backend"] == "cpu" and manifest["source"]["bindings_version"] == "0.3.36"
    for name in ("llama-server", "llama-cli", "llama-quantize", "llama-bench", "llama-imatrix", "llama-perplexity"):
        entry = manifest["binaries"][name]
        assert Path(entry["path"]).stat().st_size == entry["size"] > 0
    assert "libllama.so" in manifest["libraries"]
    assert Path(manifest["path"], "build.log").stat().st_size > 0
    assert manifest["compiler"] and manifest["build_seconds"] > 0


@pytest.mark.real_model
def test_run_uses_the_builds_library(built_home):
    proc = run_gemmactl(["run", "--json", "--max-tokens", "8", "Question: What is the capital of France?\nAnswer:"])
    assert proc.returncode == 0, proc.stderr
    payload = json.loads(proc.stdout)
    assert payload["model"]["library"].startswith("build ")
    assert "Paris" in payload["answer"]
    assert payload["notices"] == []


@pytest.mark.real_model
def test_a_build_for_other_bindings_falls_back_with_a_warning(built_home):
    active = (built_home / "builds" / "ACTIVE").read_text().strip()
    # A private copy of the builds folder, so the shared cache is not touched.
    (built_home / "builds").unlink()
    build_dir = built_home / "builds" / active
    build_dir.mkdir(parents=True)
    shared = Path(os.path.realpath(built_home / "sources")).parent / "builds" / active / "manifest.json"
    manifest = json.loads(shared.read_text())
    manifest["source"]["bindings_version"] = "0.0.1"
    (build_dir / "manifest.json").write_text(json.dumps(manifest))
    (built_home / "builds" / "ACTIVE").write_text(active)
    proc = run_gemmactl(["run", "--max-tokens", "8", "Question: What is the capital of France?\nAnswer:"])
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "Warning:" in proc.stderr and "0.3.36" in proc.stderr and "gemmactl build" in proc.stderr


@pytest.mark.real_model
def test_doctor_proves_where_the_layers_ran(built_home):
    proc = run_gemmactl(["doctor", "--json"])
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["build"]["backend"] == "cpu"
    proof = report["proof"]
    assert proof["library"] == f"build {report['build']['build_id']}"
    assert proof["answer"].startswith("Paris")
    assert proof["model_buffers_mib"]  # read from llama.cpp's own log
    assert "AMX_INT8" not in proof["system_info"]  # the build leaves AMX out
    if not report["machine"]["gpus"]:
        assert not any("CPU-only" in w for w in report["warnings"])


def test_doctor_without_a_build_warns_with_the_fix(isolated_home):
    proc = run_gemmactl(["doctor", "--no-proof"])
    assert proc.returncode == 0
    assert "WARNING: no llama.cpp build" in proc.stderr and "gemmactl build" in proc.stderr


def test_a_failed_build_names_the_step_and_the_log(tmp_path, isolated_home):
    tree = tmp_path / "llama.cpp"
    (tree / "include").mkdir(parents=True)
    (tree / "gguf-py" / "gguf").mkdir(parents=True)
    (tree / "include" / "llama.h").write_text("")
    (tree / "convert_hf_to_gguf.py").write_text("")
    (tree / "CMakeLists.txt").write_text('cmake_minimum_required(VERSION 3.14)\nproject(x)\nmessage(FATAL_ERROR "boom: no compiler today")\n')
    proc = run_gemmactl(["build", "--backend", "cpu", "--source", str(tree)])
    assert proc.returncode == 1
    line = [l for l in proc.stderr.splitlines() if l.startswith("Error:")][0]
    assert "configure step" in line and "boom" in line and "build.log" in line
    assert "Traceback" not in proc.stderr
    log = next(isolated_home.glob("builds/*/build.log"))
    assert "boom: no compiler today" in log.read_text()
    assert not list(isolated_home.glob("builds/*/manifest.json"))  # nothing half-registered
    assert not (isolated_home / "builds" / "ACTIVE").exists()
