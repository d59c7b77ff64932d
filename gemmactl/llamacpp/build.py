"""Build llama.cpp from source with the right kernels for this machine, into the store.

A build lives in `$GEMMACTL_HOME/builds/<build id>/`; the id hashes (source, backend, flags,
targets), so building the same thing again is a no-op. `manifest.json` is written last, so a
directory without one is an unfinished build and is redone.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from gemmactl.errors import BuildError, InvalidOptionError, ToolchainMissingError
from gemmactl.fileio import atomic_write_text, exclusive_lock, sha256_file
from gemmactl.llamacpp.source import SourceTree
from gemmactl.machine import Machine
from gemmactl.store import Store, utc_now

BUILD_FORMAT = "gemmactl-llama-build"
BUILD_VERSION = 1
BACKENDS = ("auto", "cpu", "cuda", "vulkan")
BINARIES = ("llama-server", "llama-cli", "llama-quantize", "llama-bench", "llama-imatrix", "llama-perplexity",
            "ggml-rpc-server")  # the last: `gemmactl worker`, a box that lends its memory to another's model

# Nothing in a build may reach the network: no prebuilt web UI, no HTTPS client.
COMMON_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DGGML_RPC=ON",  # --rpc on the head, ggml-rpc-server on workers (docs/rpc.md)
)

# /proc/cpuinfo flag → ggml option. AMX is left off on purpose: the AMX matmul of this
# llama.cpp segfaults (ggml_backend_amx_mul_mat) on the embedded model on an AMX Xeon.
_X86_FEATURES = {
    "sse4_2": "GGML_SSE42", "avx": "GGML_AVX", "avx2": "GGML_AVX2", "fma": "GGML_FMA", "f16c": "GGML_F16C",
    "bmi2": "GGML_BMI2", "avx_vnni": "GGML_AVX_VNNI", "avx512f": "GGML_AVX512", "avx512vbmi": "GGML_AVX512_VBMI",
    "avx512_vnni": "GGML_AVX512_VNNI", "avx512_bf16": "GGML_AVX512_BF16",
}

Progress = Callable[[str, float, str], None]  # (step, elapsed seconds, latest output line)


@dataclass
class BuildPlan:
    """Everything decided before compiling: source, backend, flags and the build id."""

    source: SourceTree
    backend: str
    gpu_archs: list[str]
    cmake_flags: list[str]
    targets: list[str]
    jobs: int
    generator: str
    build_id: str
    build_dir: Path

    @property
    def cmake_dir(self) -> Path:
        return self.build_dir / "cmake"

    @property
    def log_path(self) -> Path:
        return self.build_dir / "build.log"


@dataclass
class BuildManifest:
    build_id: str
    path: str
    source: dict
    backend: str
    gpu_archs: list[str]
    compiler: str
    cmake_flags: list[str]
    targets: list[str]
    created: str
    build_seconds: float
    lib_dir: str
    binaries: dict[str, dict] = field(default_factory=dict)
    libraries: dict[str, dict] = field(default_factory=dict)
    format: str = BUILD_FORMAT
    version: int = BUILD_VERSION

    def to_dict(self) -> dict:
        return asdict(self)

    def binary(self, name: str) -> Path:
        entry = self.binaries.get(name)
        if entry is None:
            raise BuildError(
                f"the active llama.cpp build {self.build_id} has no {name}",
                hint="Rebuild with `gemmactl build --force`.",
            )
        return Path(entry["path"])


def builds_dir(store: Store) -> Path:
    return store.home / "builds"


def plan_build(
    store: Store,
    source: SourceTree,
    machine: Machine,
    *,
    backend: str = "auto",
    cuda_arch: str | None = None,
    jobs: int | None = None,
    targets: tuple[str, ...] = BINARIES,
) -> BuildPlan:
    """Check the toolchain, resolve the backend and flags, and derive the build id."""
    resolved = resolve_backend(backend, machine, cuda_arch)
    generator = "Ninja" if shutil.which("ninja") else "Unix Makefiles"
    flags = list(COMMON_FLAGS)
    archs: list[str] = []
    if resolved == "cuda":
        archs = [cuda_arch] if cuda_arch else sorted({gpu.cuda_arch for gpu in machine.gpus})
        flags += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={';'.join(archs)}"]
    elif resolved == "vulkan":
        flags += ["-DGGML_VULKAN=ON"]
    flags += cpu_flags(machine)
    identity = json.dumps(
        {"source": [source.version, source.commit], "backend": resolved, "flags": flags, "targets": sorted(targets)},
        sort_keys=True,
    )
    build_id = hashlib.sha256(identity.encode()).hexdigest()[:12]
    return BuildPlan(
        source=source,
        backend=resolved,
        gpu_archs=archs,
        cmake_flags=flags,
        targets=list(targets),
        jobs=jobs or os.cpu_count() or 1,
        generator=generator,
        build_id=build_id,
        build_dir=builds_dir(store) / build_id,
    )


def cpu_flags(machine: Machine) -> list[str]:
    """ggml CPU options: explicit x86 features from /proc/cpuinfo (AMX off), else -march=native."""
    if machine.arch not in ("x86_64", "AMD64") or not machine.cpu_flags:
        return ["-DGGML_NATIVE=ON"]
    have = set(machine.cpu_flags)
    return ["-DGGML_NATIVE=OFF"] + [
        f"-D{option}={'ON' if flag in have else 'OFF'}" for flag, option in sorted(_X86_FEATURES.items())
    ] + ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]


def resolve_backend(backend: str, machine: Machine, cuda_arch: str | None = None) -> str:
    """The concrete backend for this machine; checks the tools it needs (cheap, before any work)."""
    if backend not in BACKENDS:
        raise InvalidOptionError(f"unknown backend '{backend}'; choose one of {', '.join(BACKENDS)}")
    _require("cmake", "cmake", "apt-get install cmake (or pip install cmake)")
    if not (shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")):
        raise ToolchainMissingError(
            "no C++ compiler found (c++, g++ or clang++)", hint="Install one: apt-get install build-essential."
        )
    if not shutil.which("ninja"):
        _require("make", "make", "apt-get install ninja-build (or make)")
    if backend == "auto":
        return "cuda" if machine.gpus and machine.cuda_toolkit else "cpu"
    if backend == "cuda":
        _require("nvcc", "the CUDA toolkit (nvcc)", "install the CUDA toolkit, or build with --backend cpu")
        if not machine.gpus and not cuda_arch:
            raise InvalidOptionError(
                "--backend cuda, but no NVIDIA GPU was found (nvidia-smi lists none)",
                hint="Build with --backend cpu, or pass --cuda-arch (e.g. 90) to build for another machine.",
            )
    if backend == "vulkan":
        _require("glslc", "the Vulkan shader compiler (glslc)", "apt-get install glslc libvulkan-dev")
    return backend


def _require(program: str, what: str, how: str) -> None:
    if not shutil.which(program):
        raise ToolchainMissingError(f"{what} is not installed", hint=f"Install it: {how}.")


def find_build(store: Store, build_id: str) -> BuildManifest | None:
    """The finished build with this id, if there is one."""
    path = builds_dir(store) / build_id / "manifest.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if data.get("format") != BUILD_FORMAT or data.get("version", 0) > BUILD_VERSION:
        return None
    return BuildManifest(**data)


def active_build(store: Store) -> BuildManifest | None:
    """The build that servers and the in-process backend use: the last one made."""
    try:
        build_id = (builds_dir(store) / "ACTIVE").read_text().strip()
    except OSError:
        return None
    return find_build(store, build_id) if build_id else None


def require_build(store: Store, needed_for: str) -> BuildManifest:
    """The active build, for a command that needs llama.cpp's own programs; a clear error without one."""
    build = active_build(store)
    if build is None:
        raise BuildError(f"{needed_for} needs a llama.cpp build, and there is none", hint="Run `gemmactl build` first.")
    return build


def run_build(store: Store, plan: BuildPlan, *, force: bool = False, progress: Progress | None = None) -> tuple[BuildManifest, bool]:
    """Configure and compile; returns (manifest, built) — built is False when it already existed."""
    progress = progress or (lambda step, elapsed, line: None)
    with _build_lock(plan.build_dir):
        existing = find_build(store, plan.build_id)
        if existing and not force:
            _set_active(store, plan.build_id)
            return existing, False
        if plan.build_dir.exists():
            shutil.rmtree(plan.build_dir / "cmake", ignore_errors=True)
            (plan.build_dir / "manifest.json").unlink(missing_ok=True)
        plan.build_dir.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        configure = ["cmake", "-S", str(plan.source.path), "-B", str(plan.cmake_dir), "-G", plan.generator, *plan.cmake_flags]
        compile_ = ["cmake", "--build", str(plan.cmake_dir), "--config", "Release", "-j", str(plan.jobs),
                    "--target", "llama", *plan.targets]
        with open(plan.log_path, "w", encoding="utf-8") as log:
            _run_step("configure", configure, log, plan, start, progress)
            _run_step("compile", compile_, log, plan, start, progress)
        manifest = _write_manifest(plan, time.monotonic() - start)
        # Object files are not needed once linked; a finished build keeps binaries and libraries.
        for leftovers in plan.cmake_dir.rglob("CMakeFiles"):
            shutil.rmtree(leftovers, ignore_errors=True)
        _set_active(store, plan.build_id)
        return manifest, True


def _run_step(step: str, cmd: list[str], log, plan: BuildPlan, start: float, progress: Progress) -> None:
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    progress(step, time.monotonic() - start, "")
    tail: list[str] = []
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    except OSError as exc:
        raise BuildError(f"the {step} step could not start: {exc}", hint=f"See the log: {plan.log_path}") from exc
    assert proc.stdout is not None
    for line in proc.stdout:
        log.write(line)
        tail = (tail + [line.rstrip()])[-40:]
        progress(step, time.monotonic() - start, line.rstrip())
    code = proc.wait()
    log.flush()
    if code != 0:
        detail = _error_detail(tail)
        raise BuildError(
            f"the {step} step of the llama.cpp build failed (exit {code}): {detail}",
            hint=f"The full log is {plan.log_path}; rerun with --jobs 1 for a clearer one.",
        )


def _error_detail(lines: list[str]) -> str:
    """The most telling line of a failed step: a compiler error, else CMake's message, else the last line."""
    compiler = [line for line in lines if re.search(r"\berror:", line)]
    if compiler:
        return compiler[0].strip()[:200]
    for i, line in enumerate(lines):
        if line.startswith("CMake Error"):
            following = next((l.strip() for l in lines[i + 1:] if l.strip()), "")
            return f"{line.strip()} {following}"[:200]
    meaningful = [line for line in lines if line.strip()]
    return (meaningful or ["no output"])[-1].strip()[:200]


def _write_manifest(plan: BuildPlan, seconds: float) -> BuildManifest:
    bin_dir = plan.cmake_dir / "bin"
    binaries = {name: _file_entry(bin_dir / name) for name in plan.targets if (bin_dir / name).exists()}
    missing = [name for name in plan.targets if name not in binaries]
    if missing:
        raise BuildError(f"the build finished without {', '.join(missing)}", hint=f"See the log: {plan.log_path}")
    libraries = {path.name: _file_entry(path) for path in sorted(bin_dir.glob("lib*.so"))}
    manifest = BuildManifest(
        build_id=plan.build_id,
        path=str(plan.build_dir),
        source={
            "path": str(plan.source.path),
            "version": plan.source.version,
            "commit": plan.source.commit,
            "bindings_version": plan.source.bindings_version,
        },
        backend=plan.backend,
        gpu_archs=plan.gpu_archs,
        compiler=_compiler_version(plan),
        cmake_flags=plan.cmake_flags,
        targets=plan.targets,
        created=utc_now(),
        build_seconds=round(seconds, 1),
        lib_dir=str(bin_dir),
        binaries=binaries,
        libraries=libraries,
    )
    atomic_write_text(plan.build_dir / "manifest.json", json.dumps(manifest.to_dict(), indent=2))
    return manifest


def _file_entry(path: Path) -> dict:
    return {"path": str(path), "sha256": sha256_file(path), "size": path.stat().st_size}


def _compiler_version(plan: BuildPlan) -> str:
    cache = plan.cmake_dir / "CMakeCache.txt"
    compiler = "c++"
    try:
        if match := re.search(r"^CMAKE_CXX_COMPILER:\w+=(.+)$", cache.read_text(), re.MULTILINE):
            compiler = match.group(1).strip()
        out = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return compiler
    first = out.strip().splitlines()[0] if out.strip() else compiler
    if plan.backend == "cuda":
        from gemmactl.machine import cuda_toolkit

        first += f"; nvcc {cuda_toolkit()}"
    return first


def _set_active(store: Store, build_id: str) -> None:
    atomic_write_text(builds_dir(store) / "ACTIVE", build_id + "\n")


def _build_lock(build_dir: Path):
    return exclusive_lock(build_dir.parent / f"{build_dir.name}.lock")
