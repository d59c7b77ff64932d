"""The llama.cpp source tree: the one vendored in the llama-cpp-python sdist, or a user's checkout."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from gemmactl.errors import BuildError, InvalidOptionError
from gemmactl.store import Store

BINDINGS = "llama-cpp-python"
# Files that make a directory a llama.cpp tree we can build and convert with.
_MARKERS = ("CMakeLists.txt", "include/llama.h", "convert_hf_to_gguf.py", "gguf-py/gguf")


@dataclass(frozen=True)
class SourceTree:
    """A llama.cpp tree and what identifies it in build ids and manifests."""

    path: Path
    version: str  # "llama-cpp-python 0.3.36 sdist" or "checkout"
    commit: str  # git commit, or the sdist's sha256 when there is no git history
    bindings_version: str | None  # the llama-cpp-python version this tree ships with, if any


def bindings_version() -> str | None:
    """The installed llama-cpp-python version, read without importing it."""
    from importlib import metadata

    try:
        return metadata.version(BINDINGS)
    except metadata.PackageNotFoundError:
        return None


def check_source_dir(path: Path) -> Path:
    """Refuse a directory that is not a llama.cpp tree."""
    path = Path(path).expanduser().resolve()
    if not path.is_dir():
        raise InvalidOptionError(f"--source {path} is not a directory")
    missing = [marker for marker in _MARKERS if not (path / marker).exists()]
    if missing:
        raise InvalidOptionError(
            f"{path} is not a llama.cpp source tree (missing {', '.join(missing)})",
            hint="Pass the top folder of a llama.cpp checkout, or leave out --source to use the bundled one.",
        )
    return path


def user_source(path: Path) -> SourceTree:
    """A user's llama.cpp checkout, identified by its git commit when it has one."""
    path = check_source_dir(path)
    commit = _git(path, "rev-parse", "HEAD") or _tree_fingerprint(path)
    return SourceTree(path=path, version="checkout", commit=commit, bindings_version=None)


def bundled_source(store: Store, version: str | None = None) -> SourceTree:
    """The llama.cpp tree of the llama-cpp-python sdist (fetched with pip once, kept in the store)."""
    version = version or bindings_version()
    if version is None:
        raise BuildError(
            "llama-cpp-python is not installed, so there is no bundled llama.cpp version to build",
            hint="Install gemmactl again, or pass --source DIR with a llama.cpp checkout.",
        )
    root = store.home / "sources" / f"llama.cpp-{version}"
    stamp = root / ".gemmactl-source"
    if not stamp.exists():
        _fetch_sdist_tree(version, root)
    return SourceTree(
        path=root, version=f"{BINDINGS} {version} sdist", commit=stamp.read_text().strip(), bindings_version=version
    )


def _fetch_sdist_tree(version: str, root: Path) -> None:
    """pip download the sdist, unpack its vendor/llama.cpp into root (atomically)."""
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root.parent, prefix=".fetch-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", tmp,
               f"{BINDINGS}=={version}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        archives = list(Path(tmp).glob("*.tar.gz"))
        if proc.returncode != 0 or not archives:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise BuildError(
                f"could not fetch the {BINDINGS} {version} source with pip: {last}",
                hint="Check that PyPI is reachable, or pass --source DIR with a llama.cpp checkout.",
            )
        archive = archives[0]
        digest = hashlib.sha256(archive.read_bytes()).hexdigest()
        prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
        unpack = Path(tmp) / "tree"
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
            for member in members:
                member.name = member.name[len(prefix):]
            tar.extractall(unpack, members=[m for m in members if m.name], filter="data")
        check_source_dir(unpack)
        (unpack / ".gemmactl-source").write_text(f"sdist-sha256:{digest}\n")
        if root.exists():
            shutil.rmtree(root)
        os.replace(unpack, root)


def _git(path: Path, *args: str) -> str | None:
    try:
        proc = subprocess.run(["git", "-C", str(path), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() if proc.returncode == 0 and proc.stdout.strip() else None


def _tree_fingerprint(path: Path) -> str:
    """Without git: a hash of the top-level CMake file and the public header."""
    digest = hashlib.sha256()
    for name in ("CMakeLists.txt", "include/llama.h"):
        digest.update((path / name).read_bytes())
    return "tree-sha256:" + digest.hexdigest()
