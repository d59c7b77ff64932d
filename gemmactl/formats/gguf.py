"""HF checkpoint → GGUF: llama.cpp's converter, then llama-quantize.

The converter is the `convert_hf_to_gguf.py` of the active build's own source tree (run with that
tree's gguf-py), so the file it writes is one that build reads. Intermediates live in a temporary
folder next to the output and are removed whatever happens; the output appears only complete.
Registering the file in the store is the quantize command's job (gemmactl/store/quantize.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from gemmactl.errors import BuildError, GemmactlError, InvalidOptionError, UnsupportedModelError
from gemmactl.fileio import sha256_file

if TYPE_CHECKING:  # the build is passed in; formats never look it up
    from gemmactl.llamacpp.build import BuildManifest

# llama-quantize's types that make sense for Gemma (F16/BF16 skip quantization altogether).
GGUF_TYPES = (
    "F16", "BF16", "Q8_0", "Q6_K", "Q5_K_M", "Q5_K_S", "Q5_0", "Q5_1", "Q4_K_M", "Q4_K_S", "Q4_0", "Q4_1",
    "Q3_K_L", "Q3_K_M", "Q3_K_S", "Q2_K", "IQ4_XS", "IQ4_NL", "IQ3_M", "IQ3_S", "IQ3_XS", "IQ3_XXS",
    "IQ2_M", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_M", "IQ1_S", "TQ1_0", "TQ2_0",
)
# llama-quantize refuses these without an importance matrix.
NEEDS_IMATRIX = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M")
SUPPORTED_ARCHITECTURES = (
    "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration", "Gemma3TextModel",
    "Gemma4ForCausalLM", "Gemma4ForConditionalGeneration",
    "Gemma4AssistantForCausalLM",  # Gemma 4's MTP assistant: a draft for --spec-type draft-mtp (docs/speculation.md)
)

Progress = Callable[[str, float, float | None], None]  # (step, done, total or None when unknown)

# What the tools print as they go: the converter one line per tensor ("NAME, bf16 --> BF16, shape
# = {…}") and then its writer's tqdm bar ("Writing:  45%|…"), llama-quantize "[  12/ 340] NAME".
_CONVERTED_TENSOR = re.compile(r" --> \w+, shape = ")
_WRITING = re.compile(r"^Writing:\s+(\d+)%")
_QUANTIZED = re.compile(r"^\[\s*(\d+)/\s*(\d+)\]")


@dataclass(frozen=True)
class GgufResult:
    """A GGUF written by quantize_to_gguf: where, its checksum, how it was made."""

    path: Path
    sha256: str
    quant: str
    imatrix: str | None  # the importance matrix used: a file, or "calibration:TEXTFILE"
    seconds: float


def normalize_type(name: str) -> str:
    """Check a quant type name (any case); list the valid ones when it is unknown."""
    upper = name.upper()
    if upper not in GGUF_TYPES:
        raise InvalidOptionError(f"unknown GGUF type '{name}'; valid types: {', '.join(GGUF_TYPES)}")
    return upper


def checkpoint_architecture(path: Path) -> str:
    """The architecture in a checkpoint's config.json, if the converter supports it."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except ValueError as exc:
        raise UnsupportedModelError(f"{Path(path) / 'config.json'} is not valid JSON: {exc}") from exc
    architecture = (config.get("architectures") or ["unknown"])[0]
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{path} is a {architecture} checkpoint; gemmactl converts {', '.join(SUPPORTED_ARCHITECTURES)}",
            hint="Use a Gemma 3 or Gemma 4 checkpoint.",
        )
    return architecture


def quantize_to_gguf(
    checkpoint: Path,
    quant: str,
    build: "BuildManifest",
    out_path: Path,
    *,
    log_path: Path,
    imatrix: Path | None = None,
    calibration: Path | None = None,
    progress: Progress | None = None,
) -> GgufResult:
    """Convert, (optionally) compute an importance matrix, quantize; the file appears at out_path only complete."""
    progress = progress or (lambda step, done, total: None)
    if quant in NEEDS_IMATRIX and not (imatrix or calibration):
        raise InvalidOptionError(f"{quant} needs an importance matrix", hint="Pass --imatrix FILE or --calibration TEXTFILE.")
    source_tree = Path(build.source["path"])
    converter = source_tree / "convert_hf_to_gguf.py"
    if not converter.is_file():
        raise BuildError(f"the build's source tree {source_tree} has no convert_hf_to_gguf.py", hint="Run `gemmactl build --force`.")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    remove_partial_outputs(out_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(dir=out_path.parent, prefix=".quantize-") as tmp, open(log_path, "w") as log:
        outtype = quant.lower() if quant in ("F16", "BF16") else "bf16"
        converted = Path(tmp) / f"model-{outtype}.gguf"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(source_tree / "gguf-py"), os.environ.get("PYTHONPATH", "")]))
        _step("convert", [sys.executable, str(converter), str(checkpoint), "--outtype", outtype, "--outfile", str(converted)],
              log, log_path, env, progress=_converter_progress(progress, _tensor_count(checkpoint)))
        result = converted
        if quant not in ("F16", "BF16"):
            if calibration:
                imatrix = Path(tmp) / "imatrix.gguf"
                progress("imatrix", 0, None)
                _step("imatrix", [str(build.binary("llama-imatrix")), "-m", str(converted), "-f", str(calibration), "-o", str(imatrix)], log, log_path)
            result = Path(tmp) / f"model-{quant}.gguf"
            cmd = [str(build.binary("llama-quantize"))]
            if imatrix:
                cmd += ["--imatrix", str(imatrix)]

            def quantized(line: str) -> None:
                if match := _QUANTIZED.match(line):
                    progress("quantize", int(match.group(1)), int(match.group(2)))

            progress("quantize", 0, None)
            _step("quantize", cmd + [str(converted), str(result), quant], log, log_path, progress=quantized)
            converted.unlink()  # free the disk before the final move
        progress("checksum", 0, None)
        digest = sha256_file(result)
        os.replace(result, out_path)
    used = str(imatrix) if imatrix and not calibration else ("calibration:" + str(calibration) if calibration else None)
    return GgufResult(out_path, digest, quant, used, round(time.monotonic() - start, 1))


def _step(step: str, cmd: list[str], log, log_path: Path, env: dict | None = None,
          progress: Callable[[str], None] | None = None) -> None:
    """Run one tool, its output into the log; progress sees each line (a tqdm bar's \\r updates too)."""
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    pending = b""
    for data in iter(lambda: proc.stdout.read1(65536), b""):
        log.write(data.decode("utf-8", errors="replace"))
        pending += data
        *lines, pending = re.split(rb"[\r\n]", pending)
        if progress is not None:
            for line in lines:
                progress(line.decode("utf-8", errors="replace"))
    code = proc.wait()
    if code != 0:
        log.flush()
        lines = [line for line in Path(log_path).read_text(errors="replace").splitlines() if line.strip()]
        errors = [line for line in lines if "error" in line.lower()]
        detail = (errors or lines or ["no output"])[-1][:200]
        raise BuildError(f"the {step} step failed (exit {code}): {detail}", hint=f"The full log is {log_path}.")


def _converter_progress(progress: Progress, tensors: int | None) -> Callable[[str], None]:
    """The converter's output as progress: tensors read (against the checkpoint's count), then bytes written."""
    seen = [0]
    progress("convert", 0, tensors)

    def line(text: str) -> None:
        if _CONVERTED_TENSOR.search(text):
            seen[0] += 1
            progress("convert", min(seen[0], tensors or seen[0]), tensors)
        elif match := _WRITING.match(text.strip()):
            progress("write", int(match.group(1)), 100)

    return line


def _tensor_count(checkpoint: Path) -> int | None:
    """How many tensors the checkpoint's safetensors headers list (what the converter goes through)."""
    from gemmactl.formats.int4.checkpoint import read_safetensors_header, safetensors_files

    try:
        return sum(len([k for k in read_safetensors_header(f)[0] if k != "__metadata__"])
                   for f in safetensors_files(Path(checkpoint))) or None
    except (OSError, ValueError, GemmactlError):
        return None


def remove_partial_outputs(path: Path) -> None:
    """Remove the temporary folders a killed quantize of this output left behind."""
    for leftover in path.parent.glob(".quantize-*"):
        shutil.rmtree(leftover, ignore_errors=True)
