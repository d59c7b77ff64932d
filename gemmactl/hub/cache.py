"""The Hugging Face cache as `gemmactl pull` uses it: blobs, snapshot links, refs, saved listings, purge.

Layout (the standard one huggingface_hub reads and writes):

    $HF_HUB_CACHE/models--OWNER--NAME/
      blobs/<etag>                    file contents; etag = sha256 for LFS files, git blob sha1 otherwise
      blobs/<etag>.incomplete         a partial download that the next pull continues by Range
      snapshots/<commit>/<file>       relative symlink to ../../blobs/<etag>
      refs/<revision>                 the commit a branch or tag pointed at when it was pulled

The repo listing (names, sizes, checksums of a commit) is saved under $GEMMACTL_HOME/hub/ so that
an offline pull can say exactly which files a snapshot still lacks.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gemmactl.fileio import atomic_write_text, sha256_file

COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
LISTING_FORMAT = "gemmactl-hub-listing"
LISTING_VERSION = 1
_HASH_CHUNK = 8 * 1024 * 1024


@dataclass(frozen=True)
class RepoFile:
    """One file of a hub repo at one commit, as the hub lists it."""

    name: str
    size: int
    blob_id: str | None = None  # git object id
    sha256: str | None = None  # set for LFS files

    @property
    def etag(self) -> str:
        """The name the cache stores the contents under (the hub's ETag for the file)."""
        return self.sha256 or self.blob_id or ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RepoFile:
        return cls(str(data["name"]), int(data["size"]), data.get("blob_id"), data.get("sha256"))


def hf_cache_dir() -> Path:
    """The hub cache huggingface_hub uses: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub."""
    # Read at call time: huggingface_hub reads these once at import.
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(os.path.expandvars(explicit)).expanduser()
    home = os.environ.get("HF_HOME")
    if not home:
        xdg_cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        home = os.path.join(xdg_cache, "huggingface")
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def repo_folder_name(repo_id: str) -> str:
    return "models--" + repo_id.replace("/", "--")


def git_blob_sha1(path: Path) -> str:
    """Git's object id of a file: sha1 of `blob <size>\\0` followed by the contents."""
    digest = hashlib.sha1(f"blob {os.path.getsize(path)}\0".encode())
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def content_matches(path: Path, file: RepoFile) -> bool:
    """Check a file against the hub's checksum: sha256 for LFS files, the git object id otherwise."""
    if file.sha256:
        return sha256_file(path) == file.sha256
    if file.blob_id:
        return git_blob_sha1(path) == file.blob_id
    return os.path.getsize(path) == file.size


class RepoCache:
    """One repo's folder inside the hub cache."""

    def __init__(self, cache_dir: Path, repo_id: str):
        self.cache_dir = Path(cache_dir)
        self.repo_id = repo_id
        self.root = self.cache_dir / repo_folder_name(repo_id)
        self.blobs = self.root / "blobs"
        self.snapshots = self.root / "snapshots"
        self.refs = self.root / "refs"

    def blob(self, file: RepoFile) -> Path:
        return self.blobs / file.etag

    def partial(self, file: RepoFile) -> Path:
        return self.blobs / f"{file.etag}.incomplete"

    def pointer(self, commit: str, file: RepoFile | str) -> Path:
        name = file if isinstance(file, str) else file.name
        return self.snapshots.joinpath(commit, *name.split("/"))

    def snapshot(self, commit: str) -> Path:
        return self.snapshots / commit

    def read_ref(self, revision: str) -> str | None:
        """The commit a revision names: itself when it is a full sha, else the cached ref."""
        if COMMIT_RE.match(revision):
            return revision
        try:
            commit = (self.refs / revision).read_text().strip()
        except OSError:
            return None
        return commit if COMMIT_RE.match(commit) else None

    def write_ref(self, revision: str, commit: str) -> None:
        if revision == commit:
            return
        path = self.refs / revision
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, commit)

    def present_bytes(self, file: RepoFile) -> tuple[bool, int]:
        """(complete, bytes on disk): a complete blob, or how much of a partial download exists."""
        if self.blob(file).is_file():
            return True, file.size
        try:
            return False, self.partial(file).stat().st_size
        except OSError:
            return False, 0

    def link(self, commit: str, file: RepoFile) -> Path:
        """Point snapshots/<commit>/<file> at its blob with a relative symlink, as huggingface_hub does."""
        pointer = self.pointer(commit, file)
        pointer.parent.mkdir(parents=True, exist_ok=True)
        target = os.path.relpath(self.blob(file), pointer.parent)
        if pointer.is_symlink() and os.readlink(pointer) == target:
            return pointer
        if pointer.exists() or pointer.is_symlink():
            pointer.unlink()
        os.symlink(target, pointer)
        return pointer

    def discard(self, commit: str, file: RepoFile) -> None:
        """Delete a file's blob, partial download and snapshot link."""
        for path in (self.pointer(commit, file), self.blob(file), self.partial(file)):
            _unlink(path)


# -- saved listings ------------------------------------------------------------------------------


def listing_path(home: Path, repo_id: str, commit: str) -> Path:
    return Path(home) / "hub" / repo_folder_name(repo_id) / f"{commit}.json"


def save_listing(home: Path, repo_id: str, commit: str, files: list[RepoFile]) -> None:
    """Record every file of a commit, so offline runs can tell a complete snapshot from a partial one."""
    path = listing_path(home, repo_id, commit)
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "format": LISTING_FORMAT,
        "version": LISTING_VERSION,
        "repo": repo_id,
        "commit": commit,
        "files": [file.to_dict() for file in files],
    }
    atomic_write_text(path, json.dumps(document, indent=1) + "\n")


def load_listing(home: Path, repo_id: str, commit: str) -> list[RepoFile] | None:
    """The saved listing of a commit, or None when there is none (or it is unreadable)."""
    try:
        data = json.loads(listing_path(home, repo_id, commit).read_text())
        if data.get("format") != LISTING_FORMAT or data.get("version") != LISTING_VERSION:
            return None
        return [RepoFile.from_dict(entry) for entry in data["files"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None


class CheckedBlobs:
    """Blobs whose checksum matched, keyed by etag with (size, mtime, inode), so a rerun skips hashing them again."""

    def __init__(self, home: Path, repo_id: str):
        self.path = Path(home) / "hub" / repo_folder_name(repo_id) / "checked.json"
        try:
            self.entries: dict[str, list[int]] = dict(json.loads(self.path.read_text()))
        except (OSError, ValueError, TypeError):
            self.entries = {}

    def unchanged(self, blob: Path, etag: str) -> bool:
        """True when the blob is the very file that was checked (same size, mtime and inode)."""
        try:
            return self.entries.get(etag) == _stamp(blob)
        except OSError:
            return False

    def record(self, blob: Path, etag: str) -> None:
        self.entries[etag] = _stamp(blob)

    def forget(self, etag: str) -> None:
        self.entries.pop(etag, None)

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.path, json.dumps(self.entries, indent=1, sort_keys=True) + "\n")


def _stamp(path: Path) -> list[int]:
    status = path.stat()
    return [status.st_size, status.st_mtime_ns, status.st_ino]


# -- purge ---------------------------------------------------------------------------------------


@dataclass
class PurgeResult:
    """What `rm --purge` deleted from the hub cache."""

    files: int = 0
    bytes: int = 0


def purge_pull(
    extra: dict[str, Any], commit: str | None, others: list[tuple[str | None, dict[str, Any]]]
) -> PurgeResult:
    """Delete the cache files of one pull that no other pull and no other snapshot uses.

    `extra` and `commit` describe the removed entry; `others` holds (commit, extra) of the entries
    that stay. Blobs still linked from any other snapshot in the cache are kept too.
    """
    result = PurgeResult()
    repo_id, cache_dir = extra.get("repo"), extra.get("cache_dir")
    if not repo_id or not cache_dir or not commit:
        return result
    cache = RepoCache(Path(cache_dir), repo_id)
    mine = [RepoFile.from_dict(entry) for entry in extra.get("files", [])]
    kept_pointers: set[tuple[str, str]] = set()
    kept_blobs: set[str] = set()
    for other_commit, other_extra in others:
        if other_extra.get("repo") != repo_id or Path(other_extra.get("cache_dir", "")) != Path(cache_dir):
            continue
        for entry in other_extra.get("files", []):
            file = RepoFile.from_dict(entry)
            kept_pointers.add((other_commit or "", file.name))
            kept_blobs.add(file.etag)
    doomed_pointers = {cache.pointer(commit, f) for f in mine if (commit, f.name) not in kept_pointers}
    kept_blobs |= _linked_blobs(cache, exclude=doomed_pointers)
    for pointer in doomed_pointers:
        _unlink(pointer)
    for file in mine:
        if file.etag in kept_blobs:
            continue
        blob, partial = cache.blob(file), cache.partial(file)
        if blob.is_file():
            result.files += 1
        for path in (blob, partial):
            if path.is_file():
                result.bytes += path.stat().st_size
                _unlink(path)
    _prune(cache, commit)
    return result


def _linked_blobs(cache: RepoCache, exclude: set[Path]) -> set[str]:
    """Names of the blobs that snapshot links (other than `exclude`) point at."""
    linked: set[str] = set()
    if not cache.snapshots.is_dir():
        return linked
    for root, _dirs, names in os.walk(cache.snapshots):
        for name in names:
            path = Path(root) / name
            if path in exclude or not path.is_symlink():
                continue
            linked.add(Path(os.readlink(path)).name)
    return linked


def _prune(cache: RepoCache, commit: str) -> None:
    """Remove emptied snapshot folders, refs to a vanished snapshot, and the repo folder once empty."""
    snapshot = cache.snapshot(commit)
    if snapshot.is_dir():
        for root, dirs, _names in os.walk(snapshot, topdown=False):
            for name in dirs:
                _rmdir(Path(root) / name)
        _rmdir(snapshot)
    if not snapshot.exists() and cache.refs.is_dir():
        for ref in cache.refs.rglob("*"):
            if ref.is_file() and ref.read_text().strip() == commit:
                _unlink(ref)
    has_snapshots = cache.snapshots.is_dir() and any(cache.snapshots.iterdir())
    has_blobs = cache.blobs.is_dir() and any(cache.blobs.iterdir())
    if not has_snapshots and not has_blobs and cache.root.is_dir():
        shutil.rmtree(cache.root, ignore_errors=True)


# -- small file helpers --------------------------------------------------------------------------


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def _rmdir(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:
        pass
