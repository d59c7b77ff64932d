"""Pull models from the Hugging Face hub: pick files, fetch them resumably into the HF cache, verify, register.

Transfers go through huggingface_hub (`HfApi.model_info` for the listing, `http_get` for the bytes,
its tqdm bars for progress). The partial file lives at a fixed place in the cache
(`blobs/<etag>.incomplete`) because `hf_hub_download` in recent huggingface_hub (checked: 2.4) writes
to a process-unique temporary file that it deletes on failure, so a killed pull would start big
files from zero again.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from gemmactl.errors import (
    DiskSpaceError,
    GemmactlError,
    HubAccessError,
    HubError,
    HubRepoNotFoundError,
    HubRevisionNotFoundError,
    HubUnreachableError,
    IncompleteSnapshotError,
    IntegrityError,
    InvalidOptionError,
    NotPulledError,
)
from gemmactl.hub.cache import (
    CheckedBlobs,
    RepoCache,
    RepoFile,
    content_matches,
    hf_cache_dir,
    load_listing,
    save_listing,
)
from gemmactl.hub.select import Selection, parse_reference, select_files
from gemmactl.sizes import format_size
from gemmactl.store import Artifact, Store

DEFAULT_REVISION = "main"
DEFAULT_ENDPOINT = "https://huggingface.co"


@dataclass
class PullPlan:
    """One resolved pull: the commit, the chosen files and where they go; nothing fetched yet."""

    repo_id: str
    revision: str
    commit: str
    listing: list[RepoFile]
    selection: Selection
    cache: RepoCache
    endpoint: str
    from_cache: bool  # listing read from the local record, not from the hub

    @property
    def files(self) -> list[RepoFile]:
        return self.selection.files

    @property
    def total(self) -> int:
        return sum(file.size for file in self.files)

    @property
    def store_name(self) -> str:
        if self.selection.kind == "gguf":
            return f"{self.repo_id}:{self.selection.quant}"
        return self.repo_id

    @property
    def ggufs(self) -> list[RepoFile]:
        return [f for f in self.files if f.name.lower().endswith(".gguf")] if self.selection.kind == "gguf" else []

    @property
    def path(self) -> Path:
        """What the store entry points at: the GGUF file (its first shard), else the snapshot folder."""
        if self.ggufs:
            return self.cache.pointer(self.commit, self.ggufs[0])
        return self.cache.snapshot(self.commit)


@dataclass(frozen=True)
class FileState:
    file: RepoFile
    complete: bool
    present: int  # bytes already on disk (a partial download counts)


@dataclass
class PullResult:
    plan: PullPlan
    artifact: Artifact
    downloaded: int


# -- resolving -----------------------------------------------------------------------------------


def hub_endpoint() -> str:
    """$HF_ENDPOINT (read now: huggingface_hub reads it once, at import), else the public hub."""
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def offline_requested(flag: bool = False) -> bool:
    """--offline, or HF_HUB_OFFLINE set to a true value."""
    return flag or os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def plan_pull(
    repo_id: str,
    *,
    revision: str | None = None,
    include: Iterable[str] = (),
    exclude: Iterable[str] = (),
    quant: str | None = None,
    token: str | None = None,
    offline: bool = False,
    prefer_cache: bool = False,
    store: Store | None = None,
) -> PullPlan:
    """Resolve the revision to a commit and choose the files; offline (or prefer_cache) uses the saved listing.

    repo_id may carry its quantization (OWNER/NAME:Q4_K_M, hf.co/OWNER/NAME:Q4_K_M).
    """
    repo_id, quant = parse_reference(repo_id, quant)
    revision = revision or DEFAULT_REVISION
    if any(ch.isspace() for ch in revision) or ".." in revision:
        raise InvalidOptionError(f"'{revision}' is not a valid revision", hint="Pass a branch, tag or commit sha.")
    store = store or Store()
    cache, endpoint = RepoCache(hf_cache_dir(), repo_id), hub_endpoint()
    offline = offline_requested(offline)
    commit, listing = None, None
    if offline or prefer_cache:
        commit = cache.read_ref(revision)
        listing = load_listing(store.home, repo_id, commit) if commit else None
        if listing is None and prefer_cache:  # --verify downloads nothing, so it needs what a pull recorded
            raise NotPulledError(f"{repo_id}@{revision} was never pulled here, so there is nothing to verify",
                                 hint=f"Pull it first: gemmactl pull {repo_id}" + (f" --revision {revision}"
                                                                                    if revision != DEFAULT_REVISION else ""))
        if listing is None and offline:
            raise IncompleteSnapshotError(_not_cached_message(cache, repo_id, revision, commit))
    from_cache = listing is not None
    if listing is None:
        with hub_errors(repo_id, revision, endpoint, cache.cache_dir):
            commit, listing = _fetch_listing(repo_id, revision, token, endpoint)
    selection = select_files(listing, quant=quant, include=include, exclude=exclude, repo_id=repo_id)
    return PullPlan(repo_id, revision, commit, listing, selection, cache, endpoint, from_cache)


def _fetch_listing(repo_id: str, revision: str, token: str | None, endpoint: str) -> tuple[str, list[RepoFile]]:
    """The commit a revision points at and every file there, with sizes and LFS sha256 (one API call)."""
    from huggingface_hub import HfApi

    from gemmactl import __version__

    api = HfApi(endpoint=endpoint, library_name="gemmactl", library_version=__version__)
    info = api.model_info(repo_id, revision=revision, files_metadata=True, token=token or None)
    files = [
        RepoFile(
            name=s.rfilename,
            size=s.lfs.size if s.lfs else (s.size or 0),
            blob_id=s.blob_id,
            sha256=s.lfs.sha256 if s.lfs else None,
        )
        for s in info.siblings or []
    ]
    if not info.sha:
        raise HubError(f"the hub at {endpoint} gave no commit for {repo_id}@{revision}")
    unchecked = [f.name for f in files if not f.etag]
    if unchecked:
        # Without a checksum a file could be neither stored under its cache name nor verified.
        raise HubError(f"the hub at {endpoint} listed no checksum for {', '.join(unchecked)} in {repo_id}")
    return info.sha, files


def _not_cached_message(cache: RepoCache, repo_id: str, revision: str, commit: str | None) -> str:
    if commit is None:
        return f"offline, and the cache at {cache.cache_dir} has no '{revision}' of {repo_id}"
    return (
        f"offline, and no file listing of {repo_id}@{commit[:12]} was saved by a pull, "
        "so it cannot be told what a complete snapshot holds"
    )


# -- state and space -----------------------------------------------------------------------------


def file_states(plan: PullPlan) -> list[FileState]:
    """What the cache already holds of each chosen file."""
    return [FileState(f, *plan.cache.present_bytes(f)) for f in plan.files]


def missing_bytes(states: list[FileState]) -> int:
    return sum(s.file.size - min(s.present, s.file.size) for s in states if not s.complete)


def free_bytes(path: Path) -> int:
    """Free space on the disk that holds path (or would, once its folders exist)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def check_disk_space(plan: PullPlan, states: list[FileState]) -> tuple[int, int]:
    """(bytes still to fetch, bytes free); raises DiskSpaceError when they do not fit."""
    needed, free = missing_bytes(states), free_bytes(plan.cache.cache_dir)
    if needed > free:
        raise DiskSpaceError(
            f"{plan.repo_id} needs {format_size(needed)} more in {plan.cache.cache_dir}, which has {format_size(free)} free"
        )
    return needed, free


# -- pulling and verifying -----------------------------------------------------------------------


def pull(plan: PullPlan, *, token: str | None = None, progress: bool = False, store: Store | None = None) -> PullResult:
    """Fetch what the cache lacks, check every file's checksum, then register the pull in the store."""
    store = store or Store()
    if plan.from_cache:
        _require_present(plan)
        headers = None
    else:
        check_disk_space(plan, file_states(plan))
        save_listing(store.home, plan.repo_id, plan.commit, plan.listing)
        headers = _headers(token)
    downloaded, bad, checked = 0, [], CheckedBlobs(store.home, plan.repo_id)
    with _progress_bars(progress), hub_errors(plan.repo_id, plan.revision, plan.endpoint, plan.cache.cache_dir):
        if headers is not None:
            plan.cache.write_ref(plan.revision, plan.commit)
        try:
            for file in plan.files:
                fetched, ok = _ensure_file(plan, file, headers, checked)
                downloaded += fetched
                if not ok:
                    bad.append(file)
        finally:
            checked.save()
    if bad:
        raise IntegrityError(_mismatch_message(plan, bad) + "; nothing was registered")
    artifact = _artifact(plan)
    store.add(artifact)
    return PullResult(plan, artifact, downloaded)


def verify_pull(plan: PullPlan, store: Store | None = None) -> list[RepoFile]:
    """Hash every chosen file in the cache again; deletes bad ones and raises."""
    _require_present(plan)
    checked = CheckedBlobs((store or Store()).home, plan.repo_id)
    bad = []
    for file in plan.files:
        if content_matches(plan.cache.blob(file), file):
            checked.record(plan.cache.blob(file), file.etag)
        else:
            checked.forget(file.etag)
            plan.cache.discard(plan.commit, file)
            bad.append(file)
    checked.save()
    if bad:
        raise IntegrityError(_mismatch_message(plan, bad))
    return plan.files


def _require_present(plan: PullPlan) -> None:
    missing = [f.name for f in plan.files if not plan.cache.blob(f).is_file()]
    if missing:
        raise IncompleteSnapshotError(
            f"the cache lacks {len(missing)} of the {len(plan.files)} files of {plan.repo_id}@{plan.commit[:12]}: "
            + ", ".join(missing)
        )


def _ensure_file(plan: PullPlan, file: RepoFile, headers: dict | None, checked: CheckedBlobs) -> tuple[int, bool]:
    """Make the file's blob present and checked, then link it into the snapshot: (bytes fetched, checksum ok)."""
    cache, blob, fetched = plan.cache, plan.cache.blob(file), 0
    if not blob.is_file():
        if headers is None:
            return 0, False
        fetched, ok = _download(plan, file, headers)
        if not ok:
            return fetched, False
    elif not checked.unchanged(blob, file.etag) and not content_matches(blob, file):
        checked.forget(file.etag)
        cache.discard(plan.commit, file)
        return fetched, False
    checked.record(blob, file.etag)
    cache.link(plan.commit, file)
    return fetched, True


def _download(plan: PullPlan, file: RepoFile, headers: dict) -> tuple[int, bool]:
    """Fetch into blobs/<etag>.incomplete (continuing what is there by Range), check it, promote it to the blob."""
    from huggingface_hub import hf_hub_url
    from huggingface_hub.file_download import http_get

    cache = plan.cache
    partial, blob = cache.partial(file), cache.blob(file)
    partial.parent.mkdir(parents=True, exist_ok=True)
    url = hf_hub_url(plan.repo_id, file.name, revision=plan.commit, endpoint=plan.endpoint)
    handle = _open_locked(partial)
    try:
        if blob.is_file():  # another pull finished it while this one waited for the lock
            return 0, True
        start = handle.seek(0, os.SEEK_END)
        if start > file.size:
            handle.truncate(0)
            start = handle.seek(0)
        try:
            http_get(url, handle, resume_size=start, headers=dict(headers), expected_size=file.size,
                     displayed_filename=file.name)
        except OSError as exc:
            if type(exc) is OSError and exc.errno is None:
                # http_get's own size check: the body ended early. What arrived stays for the rerun.
                raise HubError(f"the download of {file.name} ended before its {file.size} bytes arrived") from exc
            raise
        handle.flush()
        os.fsync(handle.fileno())
        fetched = max(os.path.getsize(partial) - start, 0)
        if not content_matches(partial, file):
            partial.unlink()
            return fetched, False
        os.replace(partial, blob)
        return fetched, True
    finally:
        # An empty partial holds nothing worth resuming (e.g. the hub refused the first request).
        if partial.is_file() and partial.stat().st_size == 0:
            partial.unlink(missing_ok=True)
        handle.close()


def _open_locked(path: Path):
    """Open a partial file for appending under an exclusive lock, so two pulls never write into one file."""
    while True:
        handle = open(path, "ab")
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            # The holder before us may have renamed or deleted the file: lock the one now at this path.
            if os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino:
                return handle
        except FileNotFoundError:
            pass
        handle.close()


def _headers(token: str | None) -> dict:
    from huggingface_hub.utils import build_hf_headers

    from gemmactl import __version__

    return build_hf_headers(token=token or None, library_name="gemmactl", library_version=__version__)


def _mismatch_message(plan: PullPlan, bad: list[RepoFile]) -> str:
    names = ", ".join(f"{f.name} ({'sha256' if f.sha256 else 'git object id'})" for f in bad)
    return f"checksum mismatch in {plan.repo_id}@{plan.commit[:12]}: {names}; the bad data was deleted"


def _artifact(plan: PullPlan) -> Artifact:
    ggufs = plan.ggufs
    return Artifact(
        name=plan.store_name,
        path=str(plan.path),
        format="gguf" if ggufs else "hf",
        source=f"hf:{plan.repo_id}",
        revision=plan.commit,
        size=plan.total,
        sha256=ggufs[0].sha256 if len(ggufs) == 1 else None,
        extra={
            "repo": plan.repo_id,
            "requested_revision": plan.revision,
            "kind": plan.selection.kind,
            "quant": plan.selection.quant,
            "cache_dir": str(plan.cache.cache_dir),
            "endpoint": plan.endpoint,
            "files": [f.to_dict() for f in plan.files],
        },
    )


# -- the one place huggingface_hub's exceptions become ours --------------------------------------


@contextmanager
def hub_errors(repo_id: str, revision: str, endpoint: str, cache_dir: Path) -> Iterator[None]:
    """Turn huggingface_hub, network and disk exceptions into gemmactl errors with a next step."""
    try:
        yield
    except GemmactlError:
        raise
    except Exception as exc:
        mapped = _translate(exc, repo_id, revision, endpoint, cache_dir)
        if mapped is None:
            raise
        raise mapped from exc


def _translate(exc: Exception, repo_id: str, revision: str, endpoint: str, cache_dir: Path) -> GemmactlError | None:
    from huggingface_hub import errors as hf

    status = getattr(getattr(exc, "response", None), "status_code", None)
    server = _off_hub_server(exc, endpoint)
    if isinstance(exc, hf.HfHubHTTPError) and server is not None and not isinstance(exc, hf.GatedRepoError):
        # The hub redirected the download to its CDN, and the CDN refused: its 403 is about the signed link
        # (e.g. expired), not about the account, and a rerun gets a fresh link from the hub.
        return HubError(
            f"the hub's download server {server} answered HTTP {status} for a file of {repo_id}",
            hint="Rerun: the hub hands out a fresh download link, completed files are kept and a partial file "
            "continues where it stopped.",
        )
    if isinstance(exc, hf.GatedRepoError) or (
        isinstance(exc, hf.HfHubHTTPError) and status in (401, 403) and not isinstance(exc, hf.RepositoryNotFoundError)
    ):
        return HubAccessError(
            f"{repo_id} is gated or private and the hub refused access (HTTP {status})",
            hint=f"Accept the license at {endpoint}/{repo_id}, then set HF_TOKEN (or pass --token) "
            "to a token of that account.",
        )
    if isinstance(exc, hf.RevisionNotFoundError):
        return HubRevisionNotFoundError(f"{repo_id} has no revision '{revision}'")
    if isinstance(exc, hf.RepositoryNotFoundError):
        return HubRepoNotFoundError(f"no repo {repo_id} on {endpoint}")
    if isinstance(exc, getattr(hf, "RemoteEntryNotFoundError", hf.EntryNotFoundError)):
        return HubError(f"a file {repo_id} lists is missing on the hub (HTTP {status})")
    if isinstance(exc, hf.OfflineModeIsEnabled):
        return HubUnreachableError(
            "huggingface_hub is in offline mode (HF_HUB_OFFLINE)",
            hint="Unset HF_HUB_OFFLINE, or pass --offline to use the cache.",
        )
    if isinstance(exc, hf.HfHubHTTPError):
        return HubError(f"the hub at {endpoint} answered HTTP {status} for {repo_id}")
    cause = _connection_failure(exc)
    if cause is not None:
        connecting = any("Connect" in kind.__name__ for kind in type(cause).__mro__)
        what = f"cannot reach the hub at {endpoint}" if connecting else f"the connection to the hub at {endpoint} broke"
        return HubUnreachableError(f"{what}: {_reason(cause)}")
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return DiskSpaceError(f"the disk holding {cache_dir} is full")
    return None


_HUB_HOSTS = ("huggingface.co", "hf.co")  # where the endpoint may send a request and it is still the hub


def _off_hub_server(exc: BaseException, endpoint: str) -> str | None:
    """The scheme://host[:port] that answered an HTTP error, when that is not the hub (a redirect target)."""
    response = getattr(exc, "response", None)
    try:
        url = str(response.request.url) if response is not None else ""
    except (AttributeError, RuntimeError):  # a response built without its request
        return None
    answered, hub = urlsplit(url), urlsplit(endpoint)
    if not answered.hostname or (answered.scheme, answered.netloc) == (hub.scheme, hub.netloc):
        return None
    if answered.scheme == "https" and answered.port in (None, 443) and answered.hostname in _HUB_HOSTS:
        return None
    return f"{answered.scheme}://{answered.netloc}"


def _connection_failure(exc: BaseException) -> BaseException | None:
    """The network error in an exception's chain, whichever HTTP library raised it."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        names = {kind.__name__ for kind in type(current).__mro__}
        # httpx (huggingface_hub 1.x+) raises TransportError subclasses, requests (0.x) RequestException ones.
        if isinstance(current, (ConnectionError, TimeoutError)) or names & {"TransportError", "RequestException"}:
            return current
        current = current.__cause__ or current.__context__
    return None


def _reason(exc: BaseException) -> str:
    """The most specific cause: the OS error deepest in the chain (e.g. "[Errno 111] Connection refused")."""
    current: BaseException | None = exc
    seen: set[int] = set()
    deepest: BaseException = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno is not None:
            deepest = current
        current = current.__cause__ or current.__context__
    text = str(deepest).strip() or type(deepest).__name__
    return text.splitlines()[0]


@contextmanager
def _progress_bars(enabled: bool) -> Iterator[None]:
    """huggingface_hub's own bars on or off for the pull; HF_HUB_DISABLE_PROGRESS_BARS still wins."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    if enabled or are_progress_bars_disabled():
        yield
        return
    disable_progress_bars()
    try:
        yield
    finally:
        enable_progress_bars()
