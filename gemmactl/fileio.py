"""Small file helpers shared by the store, the formats and the toolchain."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

_BLOCK = 4 << 20


def sha256_file(path: Path) -> str:
    """The sha256 hex digest of a file, read in blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def fsync_dir(path: Path) -> None:
    """Flush a directory entry so a rename survives a crash (best effort where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """Write a file so readers see the old or the new content, never half of it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
