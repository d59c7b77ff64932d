"""The one resolver: a model reference → the file or folder it names, with one set of errors.

A reference is "embedded" (the built-in model, assembled on first use), a store name (what
`gemmactl list` shows), or a path to a GGUF file, an int4-stream artifact or a checkpoint folder.
Every command resolves through `resolve_model`, saying which formats it can use.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gemmactl.errors import ArtifactMissingError, ModelNotFoundError, StoreError, WrongModelKindError
from gemmactl.formats import CHECKPOINT, GGUF, INT4_STREAM, detect_format
from gemmactl.store.embedded import EMBEDDED_NAME, ensure_embedded_model
from gemmactl.store.manifest import Artifact, Store

EMBEDDED_REFS = ("embedded", EMBEDDED_NAME)

# What a command can use, as the formats it takes and how the errors name them.
RUNNABLE = (GGUF, INT4_STREAM)  # what a backend loads
CHECKPOINTS = (CHECKPOINT,)  # what quantize reads
ARTIFACTS = (INT4_STREAM,)  # what inspect reads
ANY = (GGUF, INT4_STREAM, CHECKPOINT)  # what plan reads (plus config-only folders, as checkpoints)

_NAMES = {
    GGUF: "a GGUF file",
    INT4_STREAM: "an int4-stream artifact",
    CHECKPOINT: "a Hugging Face checkpoint folder (config.json + *.safetensors)",
}
_NEXT_STEP = {
    RUNNABLE: "Make a GGUF from a checkpoint with `gemmactl quantize REF --gguf Q4_K_M` (or --int4-stream).",
    CHECKPOINTS: "Quantize the checkpoint it was made from, or pull one with `gemmactl pull OWNER/NAME`.",
    ARTIFACTS: "`gemmactl inspect` reads int4-stream artifacts; make one with `gemmactl quantize MODEL --int4-stream`.",
}


@dataclass(frozen=True)
class ResolvedModel:
    """What a reference named: its path and format, and its store entry when it has one."""

    ref: str
    path: Path
    format: str  # "gguf", "int4-stream" or "hf"
    artifact: Artifact | None = None

    @property
    def name(self) -> str:
        """The store name, or the file or folder name."""
        return self.artifact.name if self.artifact else self.path.name

    @property
    def source(self) -> str:
        """Where it came from: the store's record, or the folder it was read from."""
        return self.artifact.source if self.artifact else f"dir:{self.path.resolve()}"

    @property
    def revision(self) -> str | None:
        return self.artifact.revision if self.artifact else None


def resolve_model(
    ref: str,
    store: Store,
    *,
    accept: tuple[str, ...] = RUNNABLE,
    missing_hint: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> ResolvedModel:
    """Find what ref names among the accepted formats; assemble the embedded model on first use.

    missing_hint: the next step for a store name that is not there yet (a recipe's `make`).
    """
    if ref in EMBEDDED_REFS and GGUF in accept:
        artifact = ensure_embedded_model(store, progress=progress)
        return ResolvedModel(ref, Path(artifact.path), GGUF, artifact)
    artifact = store.get(ref)
    if artifact is not None:
        return _from_store(ref, artifact, accept)
    path = Path(ref).expanduser()
    if path.exists():
        found = detect_format(path)
        if found not in accept:
            raise WrongModelKindError(_mismatch(path, found, accept), hint=_NEXT_STEP.get(accept))
        return ResolvedModel(ref, path, found)
    if looks_like_path(ref):
        raise ModelNotFoundError(f"no such model file or folder: {path}")
    if missing_hint:
        raise ArtifactMissingError(f"model '{ref}' is not in the store yet", hint=missing_hint)
    raise ModelNotFoundError(f"no model named '{ref}' in the store and no such file or folder")


def looks_like_path(ref: str) -> bool:
    return ref.endswith(".gguf") or "/" in ref or ref.startswith((".", "~"))


def _from_store(ref: str, artifact: Artifact, accept: tuple[str, ...]) -> ResolvedModel:
    if artifact.format not in accept:
        raise WrongModelKindError(
            f"'{ref}' is {_NAMES.get(artifact.format, 'a ' + artifact.format + ' entry')} in the store, "
            f"not {_wanted(accept)}",
            hint=_NEXT_STEP.get(accept),
        )
    path = Path(artifact.path)
    if not path.exists():
        raise StoreError(
            f"the store lists '{ref}' at {path}, but the file is gone",
            hint=f"Remove the entry with `gemmactl rm {ref} --yes` and make the model again.",
        )
    return ResolvedModel(ref, path, artifact.format, artifact)


def _wanted(accept: tuple[str, ...]) -> str:
    names = [_NAMES[kind] for kind in accept]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def _mismatch(path: Path, found: str | None, accept: tuple[str, ...]) -> str:
    if found is not None:
        return f"{path} is {_NAMES[found]}, not {_wanted(accept)}"
    if path.is_dir() and INT4_STREAM in accept:
        from gemmactl.formats.int4.reader import read_index
        from gemmactl.formats.int4.spec import INDEX_NAME, PARTIAL_MARKER

        if (path / INDEX_NAME).is_file() or (path / PARTIAL_MARKER).exists():
            read_index(path)  # a foreign or unfinished index: the reader says exactly what is wrong
    if path.is_dir():
        return f"{path} is a directory with no model in it (no config.json, no int4-stream index.json), not {_wanted(accept)}"
    if GGUF in accept:
        return f"{path} is not a GGUF file (it does not start with the GGUF magic)"
    return f"{path} is a file, not {_wanted(accept)}"
