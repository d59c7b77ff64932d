"""What a result must carry to be reproduced: versions, build, machine, model identity, flags."""

from __future__ import annotations

from gemmactl.fileio import sha256_file

import os
import platform
import sys
from pathlib import Path

from gemmactl import __version__
from gemmactl.machine import detect_machine
from gemmactl.store import Store, utc_now

# llama.cpp's `general.file_type` values (enum llama_ftype) for the common quantizations.
FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
    12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
    19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL",
    26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16",
}


def model_identity(path: Path, store: Store, metadata: dict | None) -> dict:
    """Path, format, quantization and sha256 (from the store when it recorded one, else hashed now).
    An int4-stream artifact (a folder) is named by its index: the scheme's name and the sha256 of
    index.json, which records every tensor's shard, offset and size and the source's fingerprint
    (hashing the shards themselves would read gigabytes before each run)."""
    artifact = next((a for a in store.list() if Path(a.path) == Path(path)), None)
    quantization = (artifact.extra or {}).get("quantization") if artifact else None
    if quantization is None and metadata and str(metadata.get("general.file_type", "")).isdigit():
        quantization = FILE_TYPES.get(int(metadata["general.file_type"]), f"file_type {metadata['general.file_type']}")
    index = Path(path) / "index.json"
    hashed = Path(path) if Path(path).is_file() else index if index.is_file() else None
    sha = artifact.sha256 if artifact and artifact.sha256 else (sha256_file(hashed) if hashed else None)
    fmt = artifact.format if artifact else ("gguf" if str(path).endswith(".gguf") else None)
    if hashed == index:
        scheme, shards = _int4_index(index)
        quantization, fmt = quantization or scheme, fmt or "int4-stream"
        size = sum(p.stat().st_size for p in shards if p.is_file())
    else:
        size = Path(path).stat().st_size if Path(path).is_file() else None
    return {
        "path": str(path),
        "store_name": artifact.name if artifact else None,
        "format": fmt,
        "quantization": quantization,
        "sha256": sha,
        **({"sha256_of": "index.json"} if hashed == index and not (artifact and artifact.sha256) else {}),
        "size_bytes": size,
        "architecture": (metadata or {}).get("general.architecture"),
    }


def _int4_index(index: Path) -> tuple[str | None, list[Path]]:
    """An int4-stream index's scheme name and shard files (None, [] where it cannot be read)."""
    import json

    try:
        data = json.loads(index.read_text())
        return data["scheme"]["name"], [index.parent / shard["file"] for shard in data["shards"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None, []


def llama_cpp_identity(store: Store, library_label: str | None) -> dict:
    """The active llama.cpp build's manifest (what servers run), and the bindings in this process."""
    from gemmactl.llamacpp.build import active_build

    build = active_build(store)
    identity: dict = {"library_in_process": library_label, "bindings_version": None, "build": None}
    if "llama_cpp" in sys.modules:
        identity["bindings_version"] = getattr(sys.modules["llama_cpp"], "__version__", None)
    if build is not None:
        identity["build"] = {
            "build_id": build.build_id, "backend": build.backend, "source": build.source,
            "gpu_archs": build.gpu_archs, "compiler": build.compiler, "cmake_flags": build.cmake_flags,
            "created": build.created,
        }
    return identity


def load_average() -> list[float] | None:
    """The 1-, 5- and 15-minute load averages: other work on the machine skews every figure."""
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def build_manifest(*, store: Store, model: dict, llama_cpp: dict, settings: dict, flags: dict, argv: list[str],
                   load_at_start: list[float] | None) -> dict:
    """The manifest stored with every result."""
    machine = detect_machine().to_dict()
    return {
        "gemmactl_version": __version__,
        "created": utc_now(),
        "command": " ".join(["gemmactl", "bench", *argv]),
        "flags": flags,
        "settings": settings,
        "model": model,
        "llama_cpp": llama_cpp,
        "machine": machine,
        "load_average_at_start": load_at_start,
        "load_average_at_end": load_average(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
