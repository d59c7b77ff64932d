"""`gemmactl quantize`, the library side: resolve the checkpoint, let a format write the files, register them.

The formats (gemmactl/formats/gguf.py, gemmactl/formats/int4/) only write files; the store
entry is made here, by the command that made them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from gemmactl.errors import InvalidOptionError, ModelNotFoundError, OutputExistsError
from gemmactl.store.manifest import Artifact, Store, directory_size
from gemmactl.store.refs import CHECKPOINTS, ResolvedModel, resolve_model

if TYPE_CHECKING:
    from gemmactl.llamacpp.build import BuildManifest

_NO_CHECKPOINT_HINT = "Pass a checkpoint directory, or fetch one first with `gemmactl pull OWNER/NAME`."


def default_artifact_name(ref: str, suffix: str) -> str:
    """Store name of what a quantize run makes: the model's last path component plus a suffix."""
    base = ref.rstrip("/").split("/")[-1].split(":")[0] or "model"
    return f"{base}-{suffix}"


def resolve_checkpoint(ref: str, store: Store) -> ResolvedModel:
    """The Hugging Face checkpoint a quantize run reads (a store name or a directory)."""
    try:
        return resolve_model(ref, store, accept=CHECKPOINTS)
    except ModelNotFoundError as exc:
        raise ModelNotFoundError(exc.message, hint=_NO_CHECKPOINT_HINT) from None


# -- int4-stream ---------------------------------------------------------------------------------


def quantize_int4_stream(
    ref: str,
    *,
    store: Store,
    out: Path | None = None,
    group_size: int = 32,
    shard_size: int = 1 << 30,
    embeddings: str = "int8",
    sensitive: str = "int8",
    head: str = "tied",
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
        head=head,
        calibration=Calibration.from_file(calibration) if calibration else None,
    )
    options.check()
    checkpoint = resolve_checkpoint(ref, store)
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
        checkpoint.path, out_dir, options, force=force, source=checkpoint.source, revision=checkpoint.revision,
        progress=progress,
    )
    artifact = Artifact(
        name=name,
        path=str(out_dir),
        format=STORE_FORMAT,
        source=checkpoint.source,
        revision=checkpoint.revision,
        size=directory_size(out_dir),
        extra={
            "scheme": result.index["scheme"]["name"],
            "group_size": group_size,
            "embeddings": embeddings,
            "sensitive": sensitive,
            "head": result.index["scheme"].get("head", "tied"),
            "calibration": calibration.name if calibration else None,
            "model_type": result.index["config"].get("model_type"),
            "params": result.index["totals"]["params"],
        },
    )
    store.add(artifact)
    return artifact, result


# -- GGUF ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GgufJob:
    """A GGUF quantization checked and named, before anything runs."""

    checkpoint: ResolvedModel
    architecture: str
    quant: str
    name: str
    out_path: Path


def plan_gguf(ref: str, quant: str, store: Store, out: Path | None, force: bool) -> GgufJob:
    """Check the checkpoint and the type, and choose the store name and output; refuses to overwrite without force."""
    from gemmactl.formats.gguf import checkpoint_architecture, normalize_type

    quant = normalize_type(quant)
    checkpoint = resolve_checkpoint(ref, store)
    architecture = checkpoint_architecture(checkpoint.path)
    name = default_artifact_name(ref, quant)
    path = Path(out).expanduser().resolve() if out else store.models_dir / name / f"{name}.gguf"
    if not force and (path.exists() or store.get(name) is not None):
        raise InvalidOptionError(f"{name} already exists ({path})", hint="Pass --force to replace it.")
    return GgufJob(checkpoint, architecture, quant, name, path)


def quantize_gguf(job: GgufJob, build: "BuildManifest", store: Store, *, imatrix: Path | None = None,
                  calibration: Path | None = None, progress=None) -> Artifact:
    """Convert and quantize with the build's tools, then register the GGUF; returns the entry."""
    from gemmactl.formats.gguf import quantize_to_gguf

    result = quantize_to_gguf(
        job.checkpoint.path, job.quant, build, job.out_path, log_path=store.home / "logs" / f"quantize-{job.name}.log",
        imatrix=imatrix, calibration=calibration, progress=progress,
    )
    artifact = Artifact(
        name=job.name,
        path=str(result.path),
        format="gguf",
        source=job.checkpoint.source,
        revision=job.checkpoint.revision,
        size=result.path.stat().st_size,
        sha256=result.sha256,
        extra={
            "quantization": job.quant,
            "architecture": job.architecture,
            "llama_cpp_build": build.build_id,
            "imatrix": result.imatrix,
            "seconds": result.seconds,
        },
    )
    store.add(artifact)
    return artifact
