"""`gemmactl doctor`: the machine, the active build, and proof of where the layers really ran."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from gemmactl.llamacpp.build import BuildManifest, active_build
from gemmactl.machine import Machine, detect_machine
from gemmactl.store import Store

_OFFLOADED = re.compile(r"offloaded (\d+)/(\d+) layers to GPU")
_BUFFER = re.compile(r"(\S+) model buffer size\s*=\s*([\d.]+) MiB")


@dataclass
class Proof:
    """What a short real inference showed: layers on the GPU, buffers by device, speed."""

    model: str
    library: str
    layers_offloaded: int | None
    layers_total: int | None
    model_buffers_mib: dict[str, float]
    system_info: str
    decode_tok_s: float
    answer: str
    log_tail: list[str] = field(default_factory=list)


@dataclass
class DoctorReport:
    machine: Machine
    build: BuildManifest | None
    proof: Proof | None
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        from dataclasses import asdict

        return {
            "machine": self.machine.to_dict(),
            "build": self.build.to_dict() if self.build else None,
            "proof": asdict(self.proof) if self.proof else None,
            "warnings": self.warnings,
        }


def run_doctor(store: Store, *, prove: bool = True, model_path: str | None = None) -> DoctorReport:
    """Inspect the machine and the active build; with prove, run a model (default: the embedded one) fully offloaded."""
    machine = detect_machine()
    build = active_build(store)
    report = DoctorReport(machine=machine, build=build, proof=None)
    if build is None:
        report.warnings.append(
            "no llama.cpp build: runs use the generic library bundled with llama-cpp-python. Fix: `gemmactl build`"
        )
    elif machine.gpus and build.backend == "cpu":
        report.warnings.append(
            f"this machine has {machine.gpus[0].name} but the active build {build.build_id} is CPU-only. "
            "Fix: `gemmactl build --backend cuda`"
        )
    if prove:
        report.proof = _prove(store, model_path)
        if machine.gpus and report.proof.layers_offloaded != report.proof.layers_total:
            report.warnings.append(
                f"only {report.proof.layers_offloaded}/{report.proof.layers_total} layers ran on the GPU. "
                "Fix: `gemmactl build --backend cuda --force`, then rerun `gemmactl doctor`"
            )
    return report


def _prove(store: Store, model_path: str | None) -> Proof:
    from gemmactl.embedded import ensure_embedded_model
    from gemmactl.llamacpp.library import select_library
    from gemmactl.runtime.base import GenerationRequest, GenerationStats, stream_generate
    from gemmactl.runtime.llamacpp import LlamaCppBackend, capture_llama_logs

    library = select_library(store)
    path = model_path or ensure_embedded_model(store).path
    backend = LlamaCppBackend(path, context_size=512, n_gpu_layers=-1, library=library)
    try:
        import llama_cpp

        request = GenerationRequest(prompt="Question: What is the capital of France?\nAnswer:", max_tokens=8, temperature=0)
        events = list(stream_generate(backend, request))
        stats = events[-1]
        assert isinstance(stats, GenerationStats)
        answer = "".join(e.text for e in events[:-1]).strip()
        lines = list(capture_llama_logs(llama_cpp))
        system_info = llama_cpp.llama_print_system_info().decode(errors="replace").strip()
    finally:
        backend.close()
    log = "".join(lines)
    offloaded = _OFFLOADED.search(log)
    buffers = {device: float(mib) for device, mib in _BUFFER.findall(log)}
    return Proof(
        model=str(path),
        library=backend.library,
        layers_offloaded=int(offloaded.group(1)) if offloaded else None,
        layers_total=int(offloaded.group(2)) if offloaded else None,
        model_buffers_mib=buffers,
        system_info=system_info,
        decode_tok_s=round(stats.engine_decode_tok_s or stats.decode_tok_s, 1),
        answer=answer,
        log_tail=[line.rstrip() for line in lines if "offload" in line or "buffer size" in line][-12:],
    )
