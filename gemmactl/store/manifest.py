"""The store's manifest: a models directory plus a JSON manifest of what it holds."""

from __future__ import annotations

import builtins
import json
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from gemmactl.errors import ModelNotFoundError, StoreEntryNotFoundError, StoreError
from gemmactl.fileio import atomic_write_text, exclusive_lock

MANIFEST_FORMAT = "gemmactl-manifest"
MANIFEST_VERSION = 1

_REQUIRED_FIELDS = ("name", "path", "format", "source", "size", "created")


def home_dir() -> Path:
    """Return the store home: $GEMMACTL_HOME, else $XDG_DATA_HOME/gemmactl, else ~/.local/share/gemmactl."""
    # Empty values count as unset, as the XDG base directory spec asks.
    explicit = os.environ.get("GEMMACTL_HOME")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_DATA_HOME")
    if xdg:
        return Path(xdg).expanduser() / "gemmactl"
    return Path.home() / ".local" / "share" / "gemmactl"


def utc_now() -> str:
    """Return the current time as an ISO-8601 UTC string."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def directory_size(path: Path) -> int:
    """Return the total size in bytes of a file, or of every regular file under a directory."""
    path = Path(path)
    if not path.is_dir():
        return path.stat().st_size if path.exists() else 0
    total = 0
    # Symlinks are skipped so a link to a shared cache is not counted as store space.
    for root, _dirs, files in os.walk(path):
        for name in files:
            entry = os.path.join(root, name)
            if not os.path.islink(entry):
                total += os.stat(entry).st_size
    return total


@dataclass
class Artifact:
    """One model held by the store."""

    name: str
    path: str
    format: str
    source: str
    revision: str | None
    size: int
    created: str = field(default_factory=utc_now)
    sha256: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON-ready form stored in the manifest."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Artifact:
        """Build an Artifact from its manifest form; raises ValueError when it is malformed."""
        if not isinstance(data, dict):
            raise ValueError("entry is not an object")
        missing = [key for key in _REQUIRED_FIELDS if key not in data]
        if missing:
            raise ValueError(f"entry lacks {', '.join(missing)}")
        if not isinstance(data["size"], int):
            raise ValueError("size is not an integer")
        extra = data.get("extra") or {}
        if not isinstance(extra, dict):
            raise ValueError("extra is not an object")
        # Unknown keys are ignored so a manifest written by a newer minor release still reads.
        return cls(
            name=str(data["name"]),
            path=str(data["path"]),
            format=str(data["format"]),
            source=str(data["source"]),
            revision=data.get("revision"),
            size=data["size"],
            created=str(data["created"]),
            sha256=data.get("sha256"),
            extra=dict(extra),
        )


class Store:
    """The models directory and manifest under one home directory."""

    def __init__(self, home: Path | None = None):
        # Absolute so artifact paths derived from it stay valid after a chdir.
        self.home = Path(home if home is not None else home_dir()).expanduser().absolute()
        self.models_dir = self.home / "models"
        self.manifest_path = self.home / "manifest.json"
        self.lock_path = self.home / "manifest.lock"

    # -- queries --------------------------------------------------------------------------------

    # `builtins.list` because the method named `list` shadows the builtin inside this class.
    def list(self) -> builtins.list[Artifact]:
        """Return every artifact, sorted by name."""
        artifacts = self._read()
        return [artifacts[name] for name in sorted(artifacts)]

    def get(self, name: str) -> Artifact | None:
        """Return the artifact with this name, or None."""
        return self._read().get(name)

    def resolve(self, ref: str) -> Artifact:
        """Return the artifact with this store name; raises ModelNotFoundError."""
        artifact = self.get(ref)
        if artifact is None:
            raise ModelNotFoundError(f"no model named '{ref}' in the store ({self.manifest_path})")
        return artifact

    # -- changes --------------------------------------------------------------------------------

    def add(self, artifact: Artifact) -> None:
        """Insert the artifact, replacing any entry with the same name."""
        self._update(lambda artifacts: artifacts.__setitem__(artifact.name, artifact))

    def remove(self, name: str, delete_files: bool = True) -> Artifact:
        """Drop the entry and, if asked, its files inside models_dir; returns the removed entry."""
        removed: list[Artifact] = []

        def drop(artifacts: dict[str, Artifact]) -> None:
            if name not in artifacts:
                raise StoreEntryNotFoundError(
                    f"no entry named '{name}' in the store ({self.manifest_path})"
                )
            removed.append(artifacts.pop(name))

        self._update(drop)
        artifact = removed[0]
        if delete_files:
            self._delete_files(Path(artifact.path))
        return artifact

    def contains_path(self, path: Path) -> bool:
        """Say whether the path lies strictly inside models_dir (the path itself is not followed)."""
        # Only the parent is resolved: a symlink inside the store is the store's own entry,
        # while `..` segments or a symlinked parent dir must not smuggle in an outside path.
        path = Path(path)
        candidate = path.parent.resolve() / path.name
        root = self.models_dir.resolve()
        return candidate != root and candidate.is_relative_to(root) and path.name not in ("", "..")

    # -- internals ------------------------------------------------------------------------------

    def _delete_files(self, path: Path) -> None:
        """Delete an artifact's file or directory, but only inside models_dir."""
        if not self.contains_path(path):
            return
        try:
            if path.is_symlink() or path.is_file():
                path.unlink()
            elif path.is_dir():
                shutil.rmtree(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise StoreError(
                f"removed '{path.name}' from the manifest but could not delete {path}: {exc}",
                hint="Delete the files by hand.",
            ) from exc

    def _read(self) -> dict[str, Artifact]:
        """Read the manifest; a missing one is an empty store."""
        try:
            text = self.manifest_path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise StoreError(f"cannot read the store manifest {self.manifest_path}: {exc}") from exc
        return self._parse(text)

    def _parse(self, text: str) -> dict[str, Artifact]:
        """Turn manifest text into artifacts by name, rejecting corrupt or newer manifests."""
        recover = f"Move it aside (e.g. mv {self.manifest_path} {self.manifest_path}.bad) and re-add the models."
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise StoreError(f"the store manifest {self.manifest_path} is corrupt: {exc}", hint=recover) from exc
        if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
            raise StoreError(f"{self.manifest_path} is not a gemmactl manifest", hint=recover)
        version = data.get("version")
        if not isinstance(version, int):
            raise StoreError(f"the store manifest {self.manifest_path} has no valid version", hint=recover)
        if version > MANIFEST_VERSION:
            raise StoreError(
                f"the store manifest {self.manifest_path} has version {version}, "
                f"newer than this gemmactl understands ({MANIFEST_VERSION})",
                hint="Upgrade gemmactl: pip install --upgrade gemmactl",
            )
        entries = data.get("artifacts")
        if not isinstance(entries, dict):
            raise StoreError(f"the store manifest {self.manifest_path} has no artifacts table", hint=recover)
        artifacts: dict[str, Artifact] = {}
        for name, entry in entries.items():
            try:
                artifacts[name] = Artifact.from_dict(entry)
            except ValueError as exc:
                raise StoreError(
                    f"the store manifest {self.manifest_path} has a bad entry '{name}': {exc}", hint=recover
                ) from exc
        return artifacts

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold the exclusive manifest lock, so read-modify-write cycles of several processes serialize."""
        with ExitStack() as held:
            try:
                self.home.mkdir(parents=True, exist_ok=True)
                held.enter_context(exclusive_lock(self.lock_path))
            except OSError as exc:
                raise StoreError(f"cannot open the store lock {self.lock_path}: {exc}") from exc
            yield

    def _update(self, change: Callable[[dict[str, Artifact]], None]) -> None:
        """Apply a change to the manifest under the lock and write it back atomically."""
        with self._locked():
            artifacts = self._read()
            change(artifacts)
            self._write(artifacts)

    def _write(self, artifacts: dict[str, Artifact]) -> None:
        """Replace the manifest atomically: readers see the old or the new file, never a half."""
        document = {
            "format": MANIFEST_FORMAT,
            "version": MANIFEST_VERSION,
            "artifacts": {name: artifacts[name].to_dict() for name in sorted(artifacts)},
        }
        text = json.dumps(document, indent=2, sort_keys=True) + "\n"
        try:
            atomic_write_text(self.manifest_path, text)
        except OSError as exc:
            raise StoreError(f"cannot write the store manifest {self.manifest_path}: {exc}") from exc
