"""`gemmactl quantize`, the library side: find the checkpoint, choose the output, run a format, register it.

int4-stream is `quantize_int4_stream` here; GGUF is `gemmactl.formats.gguf`. The CLI picks exactly one.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

from gemmactl.errors import InvalidOptionError, NotACheckpointError, OutputExistsError
from gemmactl.store import Artifact, Store, directory_size

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def parse_size(text: str) -> int:
    """Bytes from "1GiB", "512MiB", "2GB", "1000000": binary with `i`, decimal without."""
    match = _SIZE.match(str(text))
    if not match:
        raise InvalidOptionError(f"cannot read '{text}' as a size; write it like 1GiB, 512MiB or 2GB")
    number, unit = float(match.group(1)), (match.group(2) or "").upper()
    if "I" in unit:
        factor = 1024 ** "KMGT".index(unit[0]) * 1024
    else:
        factor = _UNITS[unit.rstrip("B") or ("B" if unit else "")]
    return int(number * factor)


def resolve_checkpoint(ref: str, store: Store) -> tuple[Path, str, str | None]:
    """(checkpoint directory, source description, revision) for a store name or a directory."""
    artifact = store.get(ref)
    if artifact is not None:
        if artifact.format != "hf":
            raise NotACheckpointError(
                f"'{ref}' is a {artifact.format} artifact in the store, not a Hugging Face checkpoint",
                hint="Quantize the checkpoint it was made from, or pull one with `gemmactl pull OWNER/NAME`.",
            )
        return Path(artifact.path), artifact.source, artifact.revision
    path = Path(ref).expanduser()
    if path.is_dir():
        return path, str(path.absolute()), None
    if path.exists():
        raise NotACheckpointError(f"{path} is a file, not a checkpoint directory")
    raise NotACheckpointError(
        f"'{ref}' is neither a checkpoint directory nor a store entry",
        hint="Pass a checkpoint directory, or fetch one first with `gemmactl pull OWNER/NAME`.",
    )


def default_artifact_name(ref: str, suffix: str) -> str:
    """Store name of what a quantize run makes: the model's last path component plus a suffix."""
    base = ref.rstrip("/").split("/")[-1].split(":")[0] or "model"
    return f"{base}-{suffix}"


def quantize_int4_stream(
    ref: str,
    *,
    store: Store,
    out: Path | None = None,
    group_size: int = 32,
    shard_size: int = 1 << 30,
    embeddings: str = "int8",
    sensitive: str = "int8",
    calibration: Path | None = None,
    force: bool = False,
    progress: Callable[[int, int], None] | None = None,
):
    """Quantize a checkpoint to an int4-stream artifact and register it; returns (Artifact, QuantizeResult)."""
    from gemmactl.formats.int4 import STORE_FORMAT, QuantizeOptions
    from gemmactl.formats.int4.calibrate import Calibration
    from gemmactl.formats.int4.quantize import quantize_checkpoint

    options = QuantizeOptions(
        group_size=group_size,
        shard_size=shard_size,
        embeddings=embeddings,
        sensitive=sensitive,
        calibration=Calibration.from_file(calibration) if calibration else None,
    )
    options.check()
    checkpoint, source, revision = resolve_checkpoint(ref, store)
    if out is None:
        name = default_artifact_name(ref, "int4")
        out_dir = store.models_dir / name
    else:
        out_dir = Path(out).expanduser().absolute()
        name = out_dir.name
    existing = store.get(name)
    if existing is not None and Path(existing.path).absolute() != out_dir and not force:
        raise OutputExistsError(
            f"the store already has an entry named '{name}' at {existing.path}",
            hint=f"Pick another --out folder name, pass --force to replace the entry, or `gemmactl rm {name}`.",
        )
    result = quantize_checkpoint(
        checkpoint, out_dir, options, force=force, source=source, revision=revision, progress=progress
    )
    artifact = Artifact(
        name=name,
        path=str(out_dir),
        format=STORE_FORMAT,
        source=source,
        revision=revision,
        size=directory_size(out_dir),
        extra={
            "scheme": result.index["scheme"]["name"],
            "group_size": group_size,
            "embeddings": embeddings,
            "sensitive": sensitive,
            "calibration": calibration.name if calibration else None,
            "model_type": result.index["config"].get("model_type"),
            "params": result.index["totals"]["params"],
        },
    )
    store.add(artifact)
    return artifact, result
