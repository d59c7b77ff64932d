"""What this machine has: CPU features, RAM, NVIDIA GPUs, the CUDA toolkit. Read, never guessed."""

from __future__ import annotations

import os
import platform
import re
import shutil
import signal
import subprocess
import threading
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    memory_bytes: int
    driver: str
    compute_cap: str  # "9.0"

    @property
    def cuda_arch(self) -> str:
        return self.compute_cap.replace(".", "")


@dataclass
class Machine:
    cpu_model: str
    cpu_cores: int
    cpu_flags: list[str]
    ram_bytes: int
    arch: str
    gpus: list[Gpu] = field(default_factory=list)
    cuda_toolkit: str | None = None  # nvcc's release, e.g. "13.0"

    def to_dict(self) -> dict:
        data = asdict(self)
        data["cpu_flags"] = [flag for flag in self.cpu_flags if flag in INTERESTING_CPU_FLAGS]
        return data


INTERESTING_CPU_FLAGS = (
    "sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "avx_vnni", "avx512f", "avx512bw", "avx512vl",
    "avx512_vnni", "avx512_bf16", "avx512vbmi", "amx_tile", "amx_int8", "amx_bf16", "asimd", "sve",
)


def cpu_info() -> tuple[str, list[str]]:
    """CPU model name and feature flags from /proc/cpuinfo (empty flags elsewhere)."""
    model, flags = platform.processor() or platform.machine(), []
    try:
        text = open("/proc/cpuinfo", encoding="utf-8", errors="replace").read()
    except OSError:
        return model, flags
    if match := re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE):
        model = match.group(1).strip()
    if match := re.search(r"^(?:flags|Features)\s*:\s*(.+)$", text, re.MULTILINE):
        flags = match.group(1).split()
    return model, flags


def ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def nvidia_gpus() -> list[Gpu]:
    """GPUs as nvidia-smi reports them; none when it is missing or fails."""
    if not shutil.which("nvidia-smi"):
        return []
    query = "index,name,memory.total,driver_version,compute_cap"
    try:
        proc = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    gpus = []
    for line in proc.stdout.strip().splitlines() if proc.returncode == 0 else []:
        parts = [part.strip() for part in line.split(",")]
        if len(parts) == 5 and parts[0].isdigit():
            memory_mib = int(float(parts[2])) if parts[2].replace(".", "").isdigit() else 0
            gpus.append(Gpu(int(parts[0]), parts[1], memory_mib * 1024 * 1024, parts[3], parts[4]))
    return gpus


def cuda_toolkit() -> str | None:
    """nvcc's release number, or None without nvcc."""
    if not shutil.which("nvcc"):
        return None
    try:
        out = subprocess.run(["nvcc", "--version"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"release (\d+\.\d+)", out)
    return match.group(1) if match else "unknown"


def detect_machine() -> Machine:
    model, flags = cpu_info()
    return Machine(
        cpu_model=model,
        cpu_cores=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1),
        cpu_flags=flags,
        ram_bytes=ram_bytes(),
        arch=platform.machine(),
        gpus=nvidia_gpus(),
        cuda_toolkit=cuda_toolkit(),
    )


class SmiPeak:
    """The largest figure one nvidia-smi query reports while it runs, read from a single nvidia-smi
    that repeats the query every interval_ms (`--loop-ms`) on its own.

    Not a new nvidia-smi for each sample: started every 50 ms, they slowed work spread over every
    core (llama.cpp's CPU layers, the engine's host layers), which waits for its slowest thread. On
    a 16-core H100 host an E4B step with 12 layers on the CPU took 40.1 ms beside them against 32.6
    alone (49.0 against 33.8 at position 400), and one looping nvidia-smi cost nothing measurable
    (benchmarks/sampler_cost.py, docs/benchmarks.md). query: e.g. ["--query-compute-apps=pid,gpu_uuid,used_memory"];
    value(fields) gives a line's figure (a size), or None to skip the line."""

    def __init__(self, query: list[str], value, interval_ms: int = 50):
        self.peak = 0
        self._value = value
        self._command = ["nvidia-smi", *query, "--format=csv,noheader,nounits", f"--loop-ms={interval_ms}"]
        self._proc = None
        self._thread = None

    def __enter__(self):
        if shutil.which("nvidia-smi"):
            try:
                self._proc = subprocess.Popen(self._command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                              text=True)
            except OSError:
                self._proc = None
        if self._proc is not None:
            self._thread = threading.Thread(target=self._read, daemon=True)
            self._thread.start()
        return self

    def _read(self) -> None:
        for line in self._proc.stdout:
            try:
                figure = self._value([part.strip() for part in line.split(",")])
            except ValueError:  # a line of another shape: skipped, the sampling goes on
                figure = None
            if figure is not None:
                self.peak = max(self.peak, figure)

    def __exit__(self, *exc):
        if self._proc is None:
            return
        # SIGINT is how its loop is meant to end ("until Ctrl+C"); a process started with SIGINT
        # ignored passes that on, so then SIGTERM, then SIGKILL.
        for stop, wait_s in ((lambda: self._proc.send_signal(signal.SIGINT), 1.0), (self._proc.terminate, 2.0),
                             (self._proc.kill, None)):
            stop()
            try:
                self._proc.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        self._thread.join(timeout=5)
        self._proc.stdout.close()


def process_gpu_peak() -> SmiPeak:
    """A context in which SmiPeak follows this process's GPU memory (CUDA context included),
    summed over the GPUs it uses: each GPU's latest figure, added up at every line."""
    pid, latest = str(os.getpid()), {}

    def value(parts: list[str]) -> int | None:
        if len(parts) == 3 and parts[0] == pid and parts[2].isdigit():
            latest[parts[1]] = int(parts[2]) * 1024 * 1024
            return sum(latest.values())
        return None

    return SmiPeak(["--query-compute-apps=pid,gpu_uuid,used_memory"], value)


def process_gpu_bytes() -> int:
    """This process's GPU memory as nvidia-smi reports it (CUDA context included); 0 without one."""
    if not shutil.which("nvidia-smi"):
        return 0
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    total = 0
    for line in out.splitlines():
        parts = [part.strip() for part in line.split(",")]
        if len(parts) == 2 and parts[0] == str(os.getpid()) and parts[1].isdigit():
            total += int(parts[1]) * 1024 * 1024
    return total
