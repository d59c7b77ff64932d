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


def run_doctor(store: Store, *, proof_backend=None) -> DoctorReport:
    """Inspect the machine and the active build; with a proof backend (a GGUF opened with every layer
    offered to the GPU, gemmactl/generate.py), run a short inference and read where the layers went."""
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
    if proof_backend is not None:
        report.proof = _prove(proof_backend)
        if machine.gpus and report.proof.layers_offloaded != report.proof.layers_total:
            report.warnings.append(
                f"only {report.proof.layers_offloaded}/{report.proof.layers_total} layers ran on the GPU. "
                "Fix: `gemmactl build --backend cuda --force`, then rerun `gemmactl doctor`"
            )
    return report


def _prove(backend) -> Proof:
    """Answer a fixed question with the backend (then close it), and read llama.cpp's log of the load."""
    import llama_cpp

    from gemmactl.runtime.base import GenerationRequest, GenerationStats, stream_generate
    from gemmactl.runtime.llamacpp import capture_llama_logs

    try:
        request = GenerationRequest(prompt="Question: What is the capital of France?\nAnswer:", max_tokens=8,
                                    temperature=0)
        events = list(stream_generate(backend, request))
        stats = events[-1]
        if not isinstance(stats, GenerationStats):
            raise TypeError("the stream did not end with its stats")
        answer = "".join(e.text for e in events[:-1]).strip()
        lines = list(capture_llama_logs(llama_cpp))
        system_info = llama_cpp.llama_print_system_info().decode(errors="replace").strip()
    finally:
        backend.close()
    path = backend.model_path
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
        decode_tok_s=round(stats.engine_decode_tok_s or stats.decode_tok_s or 0.0, 1),
        answer=answer,
        log_tail=[line.rstrip() for line in lines if "offload" in line or "buffer size" in line][-12:],
    )
