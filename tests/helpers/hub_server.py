"""A stand-in for the Hugging Face hub on 127.0.0.1: the part of its HTTP API that huggingface_hub downloads use.

Endpoints, as the hub answers them:
  GET  /api/models/{repo}[/revision/{rev}][?blobs=true]  repo info: sha, siblings (rfilename, size, blobId, lfs)
  HEAD /{repo}/resolve/{rev}/{file}                       X-Repo-Commit, ETag, X-Linked-Etag/-Size (LFS), Content-Length
  GET  /{repo}/resolve/{rev}/{file}                       the bytes; `Range: bytes=N-` gives 206 + Content-Range
Errors carry X-Error-Code (RepoNotFound, RevisionNotFound, EntryNotFound, GatedRepo) like the hub's.

Knobs (all per file name, reset between tests): drop the connection once after N bytes, answer an
HTTP status after that drop, serve same-size corrupted bytes, throttle to N bytes/s.
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

_CHUNK = 1 << 20


@dataclass
class ServedFile:
    name: str
    path: Path
    size: int
    sha256: str
    git_oid: str
    lfs: bool

    @property
    def etag(self) -> str:
        return self.sha256 if self.lfs else self.git_oid

    def pointer(self) -> bytes:
        """The git-lfs pointer file that git holds in place of an LFS file."""
        return f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256}\nsize {self.size}\n".encode()


@dataclass
class HubRepo:
    repo_id: str
    files: dict[str, ServedFile]
    commit: str
    branches: dict[str, str]  # name → commit; every commit serves the same files
    gated: bool = False
    tokens: set[str] = field(default_factory=set)


@dataclass
class Logged:
    method: str
    path: str
    range: str | None
    authorized: bool
    status: int = 0

    @property
    def file(self) -> str | None:
        return self.path.split("/resolve/", 1)[1].split("/", 1)[1] if "/resolve/" in self.path else None


def _git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _describe(name: str, path: Path, lfs: bool) -> ServedFile:
    sha, size, oid = hashlib.sha256(), 0, hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            sha.update(chunk)
            oid.update(chunk)
            size += len(chunk)
    return ServedFile(name, path, size, sha.hexdigest(), oid.hexdigest(), lfs)


class FakeHub:
    """The server and its state; `url` goes into HF_ENDPOINT."""

    def __init__(self):
        self.repos: dict[str, HubRepo] = {}
        self.requests: list[Logged] = []
        self.lock = threading.Lock()
        self.reset()
        handler = type("Handler", (_Handler,), {"hub": self})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def reset(self) -> None:
        """Forget the request log and every knob."""
        with self.lock:
            self.requests = []
        self.drop_once: dict[str, int] = {}
        self.status_after_drop: dict[str, int] = {}
        self.fail_status: dict[str, int] = {}
        self.corrupt: set[str] = set()
        self.throttle: dict[str, int] = {}

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def add_repo(self, repo_id: str, files: dict[str, Path], lfs: set[str], gated: bool = False, tokens=()) -> HubRepo:
        served = {name: _describe(name, Path(path), name in lfs) for name, path in files.items()}
        commit = hashlib.sha1(json.dumps(sorted((f.name, f.etag) for f in served.values())).encode()).hexdigest()
        repo = HubRepo(repo_id, served, commit, {"main": commit}, gated, set(tokens))
        self.repos[repo_id] = repo
        return repo

    def gets(self, name: str) -> list[Logged]:
        """The GET requests for a file's bytes, in order."""
        with self.lock:
            return [r for r in self.requests if r.method == "GET" and r.file == name]

    def downloads(self) -> list[Logged]:
        with self.lock:
            return [r for r in self.requests if r.method == "GET" and r.file is not None]


class _Handler(BaseHTTPRequestHandler):
    hub: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        pass

    def do_HEAD(self):
        self._route(head=True)

    def do_GET(self):
        self._route(head=False)

    # -- routing ---------------------------------------------------------------------------------

    def _route(self, head: bool) -> None:
        path = urlparse(self.path).path
        entry = Logged(self.command, path, self.headers.get("Range"), "authorization" in {k.lower() for k in self.headers})
        with self.hub.lock:
            self.hub.requests.append(entry)
        try:
            if path.startswith("/api/models/"):
                self._repo_info(unquote(path[len("/api/models/"):]), entry)
            elif "/resolve/" in path:
                repo_id, rest = path[1:].split("/resolve/", 1)
                revision, _, name = rest.partition("/")
                self._resolve(repo_id, unquote(revision), unquote(name), head, entry)
            else:
                self._error(404, "RepoNotFound", "Not found", entry)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _repo(self, repo_id: str, revision: str, entry: Logged) -> HubRepo | None:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound", "Repository not found", entry)
            return None
        if revision not in repo.branches and revision not in repo.branches.values():
            self._error(404, "RevisionNotFound", "Invalid rev id: " + revision, entry)
            return None
        return repo

    @staticmethod
    def _commit(repo: HubRepo, revision: str) -> str:
        return repo.branches.get(revision, revision)

    def _repo_info(self, rest: str, entry: Logged) -> None:
        repo_id, _, revision = rest.partition("/revision/")
        repo = self._repo(repo_id, revision or "main", entry)
        if repo is None:
            return
        blobs = "blobs=true" in (urlparse(self.path).query or "").lower()
        siblings = []
        for f in sorted(repo.files.values(), key=lambda f: f.name):
            sibling: dict = {"rfilename": f.name}
            if blobs:
                sibling["size"] = f.size
                sibling["blobId"] = _git_oid(f.pointer()) if f.lfs else f.git_oid
                if f.lfs:
                    sibling["lfs"] = {"size": f.size, "sha256": f.sha256, "pointerSize": len(f.pointer())}
            siblings.append(sibling)
        body = {
            "_id": repo.commit[:24],
            "id": repo.repo_id,
            "modelId": repo.repo_id,
            "sha": self._commit(repo, revision or "main"),
            "private": False,
            "gated": "manual" if repo.gated else False,
            "disabled": False,
            "tags": [],
            "siblings": siblings,
        }
        self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"}, entry)

    def _resolve(self, repo_id: str, revision: str, name: str, head: bool, entry: Logged) -> None:
        repo = self._repo(repo_id, revision, entry)
        if repo is None:
            return
        if repo.gated and self._token() not in repo.tokens:
            message = f"Access to model {repo_id} is restricted. You must have access to it and be authenticated to access it."
            self._error(401, "GatedRepo", message, entry)
            return
        served = repo.files.get(name)
        if served is None:
            self._error(404, "EntryNotFound", f"{name} does not exist", entry, {"X-Repo-Commit": repo.commit})
            return
        if name in self.hub.fail_status:
            self._error(self.hub.fail_status[name], None, "Service unavailable", entry)
            return
        headers = {
            "X-Repo-Commit": self._commit(repo, revision),
            "ETag": f'"{_git_oid(served.pointer()) if served.lfs else served.git_oid}"',
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
        }
        if served.lfs:
            headers["X-Linked-Etag"] = f'"{served.sha256}"'
            headers["X-Linked-Size"] = str(served.size)
        start, end, status = self._range(served.size)
        if status == 206:
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{served.size}"
        headers["Content-Length"] = str(end - start)
        if head:
            self._send(200, None, headers, entry)
            return
        entry.status = status
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        self._stream(served, start, end)

    # -- bodies ----------------------------------------------------------------------------------

    def _stream(self, served: ServedFile, start: int, end: int) -> None:
        hub = self.hub
        drop_at = hub.drop_once.pop(served.name, None) if start == 0 else None
        rate = hub.throttle.get(served.name)
        chunk_size = 64 * 1024 if rate else _CHUNK
        flip = served.size // 2 if served.name in hub.corrupt else -1
        sent = 0
        with open(served.path, "rb") as handle:
            handle.seek(start)
            position = start
            while position < end:
                chunk = bytearray(handle.read(min(chunk_size, end - position)))
                if position <= flip < position + len(chunk):
                    chunk[flip - position] ^= 0xFF  # same size, different bytes
                if drop_at is not None and sent + len(chunk) >= drop_at:
                    self.wfile.write(chunk[: drop_at - sent])
                    self.wfile.flush()
                    if served.name in hub.status_after_drop:
                        hub.fail_status[served.name] = hub.status_after_drop[served.name]
                    # Cut the connection mid-body, as a flaky link does.
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True
                    return
                self.wfile.write(chunk)
                sent += len(chunk)
                position += len(chunk)
                if rate:
                    time.sleep(len(chunk) / rate)

    def _range(self, size: int) -> tuple[int, int, int]:
        """(start, end, status) for the request's Range header (only `bytes=N-` and `bytes=N-M`)."""
        header = self.headers.get("Range")
        if not header or not header.startswith("bytes="):
            return 0, size, 200
        first, _, last = header[len("bytes="):].partition("-")
        start = int(first) if first else 0
        end = int(last) + 1 if last else size
        return start, min(end, size), 206

    def _token(self) -> str | None:
        auth = self.headers.get("Authorization", "")
        return auth[len("Bearer "):] if auth.startswith("Bearer ") else None

    def _error(self, status: int, code: str | None, message: str, entry: Logged, extra: dict | None = None) -> None:
        headers = {"X-Error-Message": message, "Content-Type": "application/json", **(extra or {})}
        if code:
            headers["X-Error-Code"] = code
        self._send(status, json.dumps({"error": message}).encode(), headers, entry)

    def _send(self, status: int, body: bytes | None, headers: dict, entry: Logged) -> None:
        entry.status = status
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        if body is not None:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if body is not None and self.command != "HEAD":
            self.wfile.write(body)
