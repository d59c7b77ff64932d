"""Model references → files: "embedded", a path to a GGUF or an int4-stream artifact, or a store name."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from gemmactl.embedded import EMBEDDED_NAME, ensure_embedded_model
from gemmactl.errors import ArtifactMissingError, ModelNotFoundError, NotAGGUFError, StoreError
from gemmactl.formats import is_int4_stream_dir
from gemmactl.store import Store

GGUF_MAGIC = b"GGUF"
EMBEDDED_REFS = ("embedded", EMBEDDED_NAME)
RUNNABLE_FORMATS = ("gguf", "int4-stream")  # store formats a backend can load


def is_gguf(path: Path) -> bool:
    """True when the file starts with the GGUF magic bytes."""
    try:
        with open(path, "rb") as handle:
            return handle.read(4) == GGUF_MAGIC
    except OSError:
        return False


def check_gguf_path(path: Path) -> Path:
    """Return the path if it is a readable GGUF file, else raise a clear error."""
    if not path.exists():
        raise ModelNotFoundError(f"no such model file: {path}")
    if path.is_dir():
        raise NotAGGUFError(f"{path} is a directory, not a .gguf file or an int4-stream artifact")
    if not is_gguf(path):
        raise NotAGGUFError(f"{path} is not a GGUF file (it does not start with the GGUF magic)")
    return path


def looks_like_path(ref: str) -> bool:
    return ref.endswith(".gguf") or "/" in ref or ref.startswith(".") or ref.startswith("~")


def resolve_model_ref(
    ref: str,
    store: Store,
    *,
    missing_hint: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Find the GGUF file or int4-stream directory a reference names; assemble the embedded model on first use."""
    if ref in EMBEDDED_REFS:
        return Path(ensure_embedded_model(store, progress=progress).path)
    if looks_like_path(ref) and not store.get(ref):
        path = Path(ref).expanduser()
        return path if is_int4_stream_dir(path) else check_gguf_path(path)
    artifact = store.get(ref)
    if artifact is None:
        if missing_hint:
            raise ArtifactMissingError(f"model '{ref}' is not in the store yet", hint=missing_hint)
        raise ModelNotFoundError(f"no model named '{ref}' in the store and no such file")
    path = Path(artifact.path)
    if artifact.format not in RUNNABLE_FORMATS:
        raise NotAGGUFError(
            f"'{ref}' is a {artifact.format} artifact; this backend runs GGUF files",
            hint=f"Make a GGUF from it with `gemmactl quantize {ref} --gguf Q4_K_M`.",
        )
    if not path.exists():
        raise StoreError(
            f"the store lists '{ref}' at {path}, but the file is gone",
            hint=f"Remove the entry with `gemmactl rm {ref} --yes` and make the model again.",
        )
    return path
