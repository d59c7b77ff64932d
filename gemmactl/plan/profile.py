"""Machine profiles: the bandwidths, compute rates and reserves the placement model runs on.

A profile is either shipped (gemmactl/plan/profiles/NAME.json, for planning another box) or
measured on this machine once and cached in the store (plan/machine-profile.json); `--profile`
measures again. Measurements: CPU memory bandwidth and matmul rate with numpy; with torch and a
CUDA device also device-to-device copy, pinned host-to-device copy and a bf16 matmul.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass, replace
from importlib import resources
from pathlib import Path

from gemmactl.errors import InvalidOptionError
from gemmactl.fileio import atomic_write_text
from gemmactl.machine import Machine, process_gpu_bytes

DEFAULT_PROFILE = "desktop-4g"
CACHE_NAME = "machine-profile.json"
# Kernels loaded on first use (tinygemm, attention, Triton), side streams and CUDA graphs' own
# memory: on an H200 the engine's process held 148 MiB more outside torch's allocator than a
# fresh context once loaded and captured (benchmarks/engine_memory.py), the profile's cuBLAS
# matmul accounting for part of it.
RESERVE_MARGIN_BYTES = 128 << 20
# An engine layer on the CPU pays for its eager operations beside its kernels' reads, counted in
# small operations (cpu_op_latency_s each): ENGINE_LAYER_OPS for a layer of tiny matrices, and
# ENGINE_OPS_PER_MB more for each MB of its weights (wider activations, their conversions, the
# attention's products). A Gemma 4 layer of tiny matrices took 406–441 µs on a 2-core AVX-512 host
# where one small operation took 1.9 µs (220); an E4B layer (62 MB) took 2.19 ms on an idle
# 16-core Xeon, 0.85 of them in its kernels, at 1.29 µs an operation (1,040: 13 a MB beyond the
# 220), and 4.0 ms on the 2-core host, 3.2 in its kernels, at 1.1 µs (about 730: 8 a MB).
ENGINE_LAYER_OPS = 220
ENGINE_OPS_PER_MB = 13
DEFAULT_CPU_OP_S = 2e-6
# 2: the GPU reserve is this machine's measured CUDA context; 3: the CPU kernels' rate; 4: that rate
# the fastest of its rounds (a profile measured while other work held the cores is measured again)
CACHE_VERSION = 4


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    description: str
    source: str
    gpu_name: str | None
    vram_bytes: int
    ram_bytes: int
    gpu_bandwidth: float  # bytes/s a decode can read from device memory
    cpu_bandwidth: float  # bytes/s the CPU reads from RAM, all cores
    host_to_device: float  # bytes/s of pinned host → device copies
    gpu_flops: float
    cpu_flops: float
    gpu_layer_latency_s: float  # fixed cost per layer per token on the GPU (kernel launches)
    cpu_layer_latency_s: float
    gpu_reserve_bytes: int  # CUDA context and runtime, outside any buffer llama.cpp reports
    unified_memory: bool = False  # VRAM and RAM are one pool (GB10-class)
    # bytes/s the engine's CPU int4/int8 kernels read a layer's weights at, all cores (0: not
    # measured; the engine's host layers are then priced at cpu_bandwidth). They are bound by their
    # arithmetic before the memory: 12.9-18.3 GB/s on a 2-core AVX-512 host that copies at 34.
    cpu_kernel_bandwidth: float = 0.0
    # seconds torch takes to run one small operation on the CPU (dispatch, no arithmetic to speak
    # of): what an engine layer on the host pays per operation beyond its kernels' reads (0: not
    # measured, DEFAULT_CPU_OP_S stands in).
    cpu_op_latency_s: float = 0.0

    @property
    def host_kernel_bandwidth(self) -> float:
        """What the engine's CPU kernels read weights at: measured, else the memory's copy rate."""
        return self.cpu_kernel_bandwidth or self.cpu_bandwidth

    def engine_host_layer_s(self, weight_bytes: int) -> float:
        """What one engine layer of weight_bytes on the host costs beyond its weights' reads: its
        eager operations (ENGINE_LAYER_OPS, and ENGINE_OPS_PER_MB a MB, at the measured latency of one)."""
        ops = ENGINE_LAYER_OPS + ENGINE_OPS_PER_MB * weight_bytes / 1e6
        return ops * (self.cpu_op_latency_s or DEFAULT_CPU_OP_S)

    @property
    def has_gpu(self) -> bool:
        return self.vram_bytes > 0

    def to_dict(self) -> dict:
        return asdict(self)


def shipped_profiles() -> list[str]:
    folder = resources.files("gemmactl.plan") / "profiles"
    return sorted(entry.name[: -len(".json")] for entry in folder.iterdir() if entry.name.endswith(".json"))


def load_profile(name: str) -> HardwareProfile:
    """A shipped profile by name."""
    if name not in shipped_profiles():
        raise InvalidOptionError(
            f"unknown hardware profile '{name}'",
            hint=f"Use one of: {', '.join(shipped_profiles())}.",
        )
    data = json.loads((resources.files("gemmactl.plan") / "profiles" / f"{name}.json").read_text(encoding="utf-8"))
    return _from_dict(data)


def _from_dict(data: dict) -> HardwareProfile:
    fields = HardwareProfile.__dataclass_fields__
    return HardwareProfile(**{key: data[key] for key in fields if key in data})


def gpu_free_bytes(index: int = 0) -> int | None:
    """Free memory of one NVIDIA GPU as nvidia-smi reports it, or None."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        proc = subprocess.run(
            ["nvidia-smi", f"--id={index}", "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = proc.stdout.strip().splitlines()[0].strip() if proc.returncode == 0 and proc.stdout.strip() else ""
    return int(float(text)) * 1024 * 1024 if text.replace(".", "").isdigit() else None


def _fingerprint(machine: Machine) -> dict:
    return {
        "cpu_model": machine.cpu_model,
        "cpu_cores": machine.cpu_cores,
        "ram_bytes": machine.ram_bytes,
        "gpus": [f"{gpu.name}/{gpu.memory_bytes}" for gpu in machine.gpus],
    }


def cached_profile(cache_dir: Path, machine: Machine) -> HardwareProfile | None:
    """The cached measurement of this machine, if one matches it."""
    try:
        data = json.loads((cache_dir / CACHE_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if data.get("version") != CACHE_VERSION or data.get("machine") != _fingerprint(machine):
        return None
    return _from_dict(data["profile"])


def machine_profile(cache_dir: Path, machine: Machine, *, remeasure: bool = False) -> tuple[HardwareProfile, bool]:
    """This machine's profile: the cached one, or a fresh measurement (then cached). Returns (profile, measured now)."""
    if not remeasure:
        cached = cached_profile(cache_dir, machine)
        if cached is not None:
            return cached, False
    profile = measure_profile(machine)
    cache_dir.mkdir(parents=True, exist_ok=True)
    record = {"version": CACHE_VERSION, "machine": _fingerprint(machine), "measured_at": time.time(), "profile": profile.to_dict()}
    atomic_write_text(cache_dir / CACHE_NAME, json.dumps(record, indent=2) + "\n")
    return profile, True


def _cpu_bandwidth(size: int = 256 << 20, repeats: int = 4) -> float:
    """Read+write bytes/s of large array copies, one slice per core (numpy releases the GIL)."""
    import numpy as np
    from concurrent.futures import ThreadPoolExecutor

    threads = max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))
    src = np.ones(size // 8, dtype=np.float64)
    dst = np.empty_like(src)
    bounds = np.linspace(0, src.size, threads + 1).astype(int)

    def copy(part: int) -> None:
        np.copyto(dst[bounds[part]:bounds[part + 1]], src[bounds[part]:bounds[part + 1]])

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(copy, range(threads)))  # warm up: fault the pages in
        start = time.perf_counter()
        for _ in range(repeats):
            list(pool.map(copy, range(threads)))
        elapsed = time.perf_counter() - start
    return 2 * size * repeats / elapsed


def fastest_seconds(work, rounds: int, clock=time.perf_counter) -> float:
    """The shortest of rounds timings of work(). The fastest, not the median: a round that shared
    the cores with other work (a compile, say) ran at a fraction of the rate, and a profile is kept
    until `plan --profile` measures again."""
    fastest = float("inf")
    for _ in range(rounds):
        start = clock()
        work()
        fastest = min(fastest, clock() - start)
    return fastest


def _cpu_kernel_bandwidth(copies: int = 6, repeats: int = 5) -> float:
    """Bytes/s of the engine's CPU kernels over E4B-sized MLP pairs: a 10,240×2,560 int4 matrix
    (groups of 32) and a 2,560×10,240 int8 one, one token each, as a decode step runs them
    (runtime/engine/cpu_kernels.py); 0.0 where the engine keeps dense weights on this CPU. copies
    distinct pairs (255 MB at 6), so the caches do not serve them: one pair, repeated, read
    22.7 GB/s on a 2-core AVX-512 host where an E4B step's kernels ran at 14–17."""
    try:
        import torch

        from gemmactl.runtime.engine.cpu_kernels import cpu_kernels_kept
    except ImportError:
        return 0.0
    if not cpu_kernels_kept(torch.bfloat16):
        return 0.0
    rows, columns, group = 10240, 2560, 32
    codes = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        torch.randint(0, 16, (rows, columns), dtype=torch.int32), 1)
    scales_zeros = torch.full((columns // group, rows, 2), 0.01, dtype=torch.bfloat16)
    int8 = torch.randint(-127, 128, (columns, rows), dtype=torch.int8)
    int8_scales = torch.full((columns,), 0.01, dtype=torch.bfloat16)
    pairs = [(codes.clone(), scales_zeros.clone(), int8.clone(), int8_scales.clone()) for _ in range(copies)]
    x4, x8 = torch.randn(1, columns, dtype=torch.bfloat16), torch.randn(1, rows, dtype=torch.bfloat16)

    def once() -> None:
        for packed, sz, weights, scales in pairs:
            torch.ops.aten._weight_int4pack_mm_for_cpu(x4, packed, group, sz)
            torch.ops.aten._weight_int8pack_mm(x8, weights, scales)

    with torch.inference_mode():
        once()  # warm up
        fastest = fastest_seconds(once, repeats)
    nbytes = codes.numel() * codes.element_size() + scales_zeros.numel() * 2 + int8.numel() + int8_scales.numel() * 2
    return copies * nbytes / fastest


def _cpu_op_latency(repeats: int = 2000) -> float:
    """Seconds torch takes for one small CPU operation (a product of 64 bfloat16 values), or 0.0
    without torch."""
    try:
        import torch
    except ImportError:
        return 0.0
    a = torch.ones(1, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        for _ in range(100):
            a * a
        start = time.perf_counter()
        for _ in range(repeats):
            a * a
        return (time.perf_counter() - start) / repeats


def _cpu_flops(n: int = 1024, repeats: int = 3) -> float:
    import numpy as np

    a = np.ones((n, n), dtype=np.float32)
    a @ a
    start = time.perf_counter()
    for _ in range(repeats):
        a @ a
    return 2 * n**3 * repeats / (time.perf_counter() - start)


def _gpu_numbers() -> dict | None:
    """Device copy bandwidth, pinned host→device bandwidth and bf16 matmul rate, or None without torch+CUDA."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    size = 1 << 30
    src = torch.empty(size // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    device_bw = 2 * size * 10 / (time.perf_counter() - start)
    host = torch.empty(size // 2, dtype=torch.bfloat16, pin_memory=True)
    src.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(3):
        src.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    h2d = size * 3 / (time.perf_counter() - start)
    a = torch.ones((8192, 8192), dtype=torch.bfloat16, device="cuda")
    a @ a
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        a @ a
    torch.cuda.synchronize()
    flops = 2 * 8192**3 * 5 / (time.perf_counter() - start)
    del src, dst, host, a
    torch.cuda.empty_cache()
    numbers = {"gpu_bandwidth": device_bw, "host_to_device": h2d, "gpu_flops": flops}
    # What the process holds outside torch's allocator (the CUDA context, cuBLAS, loaded kernels),
    # as nvidia-smi counts it: the reserve a budget must leave (docs/placement.md).
    context = process_gpu_bytes() - torch.cuda.memory_reserved()
    if context > 0:
        numbers["gpu_reserve_bytes"] = context + RESERVE_MARGIN_BYTES
    return numbers


def measure_profile(machine: Machine) -> HardwareProfile:
    """Measure this machine; GPU figures need torch with CUDA, else the default desktop's stand in (and the source says so)."""
    base = load_profile(DEFAULT_PROFILE)
    gpu = machine.gpus[0] if machine.gpus else None
    numbers = _gpu_numbers() if gpu else None
    if gpu and numbers:
        gpu_source = "GPU figures measured with torch" + (
            ", its CUDA context with nvidia-smi" if "gpu_reserve_bytes" in numbers else "")
        numbers["gpu_reserve_bytes"] = max(base.gpu_reserve_bytes, numbers.get("gpu_reserve_bytes", 0))
    elif gpu:
        gpu_source = f"GPU bandwidths from the {DEFAULT_PROFILE} profile (install torch with CUDA to measure them)"
        numbers = {"gpu_bandwidth": base.gpu_bandwidth, "host_to_device": base.host_to_device, "gpu_flops": base.gpu_flops}
    else:
        gpu_source = "no GPU"
        numbers = {"gpu_bandwidth": 0.0, "host_to_device": 0.0, "gpu_flops": 0.0}
    return replace(
        base,
        name="this-machine",
        description=f"{machine.cpu_model}, {machine.cpu_cores} cores" + (f", {gpu.name}" if gpu else ""),
        source=f"measured: CPU copy bandwidth and matmul with numpy, the engine's CPU kernels with torch; {gpu_source}",
        gpu_name=gpu.name if gpu else None,
        vram_bytes=gpu.memory_bytes if gpu else 0,
        ram_bytes=machine.ram_bytes,
        cpu_bandwidth=_cpu_bandwidth(),
        cpu_kernel_bandwidth=_cpu_kernel_bandwidth(),
        cpu_op_latency_s=_cpu_op_latency(),
        cpu_flops=_cpu_flops(),
        **numbers,
    )
