"""A stand-in for the Hugging Face hub on 127.0.0.1: the part of its HTTP API that huggingface_hub downloads use.

Endpoints, as the hub answers them:
  GET  /api/models/{repo}[/revision/{rev}][?blobs=true]  repo info: sha, siblings (rfilename, size, blobId, lfs)
  HEAD /{repo}/resolve/{rev}/{file}                       X-Repo-Commit, ETag, X-Linked-Etag/-Size (LFS), Content-Length
  GET  /{repo}/resolve/{rev}/{file}                       the bytes; `Range: bytes=N-` gives 206 + Content-Range
Errors carry X-Error-Code (RepoNotFound, RevisionNotFound, EntryNotFound, GatedRepo) like the hub's.

Ranges (RFC 9110 14.1.2): `bytes=N-`, `bytes=N-M` and `bytes=-N` (the last N bytes). A range that starts
at or past the end of the file is answered 416 with `Content-Range: bytes */SIZE`, as the hub and its
CDN do; an unparsable or multi-part Range is ignored (200 with the whole file).

A repo added with cdn=True serves its LFS files the way huggingface.co does: HEAD and GET of
/resolve answer 302 with the file's metadata (X-Repo-Commit, ETag, X-Linked-Etag, X-Linked-Size) and a
signed Location on a second server (`cdn_url`, another port, so another origin for the client), which
serves the bytes with Range support. Like a signed S3/CloudFront URL, the CDN answers 403 to a bad or
missing signature and 400 to a request that also carries an Authorization header.

Xet is never advertised: no X-Xet-* headers, no `Link: <...>; rel="xet-auth"`, no xetHash in listings,
no xet-read-token route. huggingface_hub therefore downloads over plain HTTP even with hf_xet installed.

Knobs (all per file name, reset between tests; they act on whichever server streams the bytes): drop
the connection once after N bytes, answer an HTTP status (from the hub) after that drop, serve
same-size corrupted bytes, throttle to N bytes/s.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlencode, urlparse

_CHUNK = 1 << 20
_RANGE_RE = re.compile(r"bytes=(\d*)-(\d*)")


@dataclass
class ServedFile:
    name: str
    path: Path
    size: int
    sha256: str
    git_oid: str
    lfs: bool
    md5: str  # what a CDN (S3) puts in its ETag: not the hub's etag

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
    cdn: bool = False  # LFS files redirect to the CDN server

    @property
    def cdn_key(self) -> str:
        """The repo's folder on the CDN (the real one uses an internal id, not the name)."""
        return hashlib.sha256(self.repo_id.encode()).hexdigest()[:24]


@dataclass
class Logged:
    method: str
    path: str
    range: str | None
    authorized: bool
    status: int = 0
    host: str = "hub"  # or "cdn"
    name: str | None = None  # the file a CDN request was for

    @property
    def file(self) -> str | None:
        if self.host == "cdn":
            return self.name
        return self.path.split("/resolve/", 1)[1].split("/", 1)[1] if "/resolve/" in self.path else None


def _git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _describe(name: str, path: Path, lfs: bool) -> ServedFile:
    sha, size, oid = hashlib.sha256(), 0, hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    md5 = hashlib.md5()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            sha.update(chunk)
            oid.update(chunk)
            md5.update(chunk)
            size += len(chunk)
    return ServedFile(name, path, size, sha.hexdigest(), oid.hexdigest(), lfs, md5.hexdigest())


class FakeHub:
    """The server and its state; `url` goes into HF_ENDPOINT."""

    def __init__(self):
        self.repos: dict[str, HubRepo] = {}
        self._described: dict[tuple[str, Path, bool], ServedFile] = {}  # two repos may serve the same file
        self.requests: list[Logged] = []
        self.lock = threading.Lock()
        self.secret = os.urandom(16)  # signs CDN URLs
        self.reset()
        self.httpd = self._serve(_Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.cdn_httpd = self._serve(_CdnHandler)
        self.cdn_url = f"http://127.0.0.1:{self.cdn_httpd.server_address[1]}"

    def _serve(self, base: type) -> ThreadingHTTPServer:
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), type(base.__name__, (base,), {"hub": self}))
        httpd.daemon_threads = True
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        return httpd

    def reset(self) -> None:
        """Forget the request log and every knob."""
        with self.lock:
            self.requests = []
        self.drop_once: dict[str, int] = {}
        self.status_after_drop: dict[str, int] = {}
        self.fail_status: dict[str, int] = {}
        self.corrupt: set[str] = set()
        self.throttle: dict[str, int] = {}
        self.url_ttl = 3600  # seconds a signed CDN URL stays valid (negative: already expired when issued)

    def stop(self) -> None:
        for httpd in (self.httpd, self.cdn_httpd):
            httpd.shutdown()
            httpd.server_close()

    def add_repo(
        self, repo_id: str, files: dict[str, Path], lfs: set[str], gated: bool = False, tokens=(), cdn: bool = False
    ) -> HubRepo:
        served = {}
        for name, path in files.items():
            key = (name, Path(path), name in lfs)
            if key not in self._described:
                self._described[key] = _describe(*key)
            served[name] = self._described[key]
        listed = json.dumps([repo_id, sorted((f.name, f.etag) for f in served.values())])
        commit = hashlib.sha1(listed.encode()).hexdigest()
        repo = HubRepo(repo_id, served, commit, {"main": commit}, gated, set(tokens), cdn)
        self.repos[repo_id] = repo
        return repo

    def cdn_location(self, repo: HubRepo, served: ServedFile) -> str:
        """A signed, expiring CDN URL for an LFS file, shaped like the hub's cdn-lfs redirects."""
        path = f"/repos/{repo.cdn_key}/{served.sha256}"
        expires = str(int(time.time()) + self.url_ttl)
        base = served.name.rsplit("/", 1)[-1]
        query = {
            "response-content-disposition": f"inline; filename*=UTF-8''{quote(base)}; filename=\"{base}\";",
            "response-content-type": "application/octet-stream",
            "Expires": expires,
            "Signature": self._signature(path, expires),
        }
        return f"{self.cdn_url}{path}?{urlencode(query)}"

    def _signature(self, path: str, expires: str) -> str:
        return hmac.new(self.secret, f"{path}\n{expires}".encode(), hashlib.sha256).hexdigest()

    def gets(self, name: str) -> list[Logged]:
        """The GET requests answered with a file's bytes (or an error), on either server, in order; not redirects."""
        with self.lock:
            return [r for r in self.requests if r.method == "GET" and r.file == name and not 300 <= r.status < 400]

    def redirects(self, name: str) -> list[Logged]:
        """The requests for a file that the hub answered with a redirect to the CDN, in order."""
        with self.lock:
            return [r for r in self.requests if r.host == "hub" and r.file == name and 300 <= r.status < 400]

    def downloads(self) -> list[Logged]:
        """Every GET answered with a file's bytes (or an error) on either server; not redirects."""
        with self.lock:
            return [r for r in self.requests if r.method == "GET" and r.file is not None and not 300 <= r.status < 400]


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
        if served.lfs and repo.cdn:
            # The hub keeps LFS bytes elsewhere: the metadata is on this response, the bytes behind Location.
            location = self.hub.cdn_location(repo, served)
            headers.update({"Location": location, "Content-Type": "text/plain; charset=utf-8"})
            self._send(302, f"Found. Redirecting to {location}".encode(), headers, entry)
            return
        self._serve_bytes(served, head, headers, entry)

    # -- bodies ----------------------------------------------------------------------------------

    def _serve_bytes(self, served: ServedFile, head: bool, headers: dict, entry: Logged) -> None:
        """Answer with the file, or the part the Range asks for (206), or 416 for a range past its end."""
        start, end, status = self._range(served.size)
        if status == 416:
            unsatisfiable = {"Content-Range": f"bytes */{served.size}", "Content-Type": "text/plain; charset=utf-8"}
            self._send(416, b"Range Not Satisfiable", unsatisfiable, entry)
            return
        if status == 206:
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{served.size}"
        headers["Content-Length"] = str(end - start)
        entry.status = status
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        if not head:
            self._stream(served, start, end)

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
        """(start, end, status) for the request's Range header: 206 for a part, 416 when it starts past the end."""
        match = _RANGE_RE.fullmatch((self.headers.get("Range") or "").strip())
        if match is None:
            return 0, size, 200  # no Range, or one this server does not do (several parts): the whole file
        first, last = match.group(1), match.group(2)
        if not first and not last:
            return 0, size, 200  # `bytes=-`: not a range, ignored
        if not first:  # bytes=-N: the last N bytes
            if int(last) == 0:
                return 0, 0, 416
            return max(size - int(last), 0), size, 206 if size else 416
        start = int(first)
        end = min(int(last) + 1, size) if last else size
        if last and int(last) < start:
            return 0, size, 200  # invalid range: ignored
        if start >= size:
            return 0, 0, 416
        return start, end, 206

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


class _CdnHandler(_Handler):
    """The second host: signed URLs to LFS bytes, like the hub's cdn-lfs / cas-bridge redirects."""

    def _route(self, head: bool) -> None:
        url = urlparse(self.path)
        authorized = "authorization" in {k.lower() for k in self.headers}
        entry = Logged(self.command, url.path, self.headers.get("Range"), authorized, host="cdn")
        with self.hub.lock:
            self.hub.requests.append(entry)
        try:
            self._serve_signed(url.path, parse_qs(url.query), head, entry)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _serve_signed(self, path: str, query: dict[str, list[str]], head: bool, entry: Logged) -> None:
        parts = path.strip("/").split("/")
        served = None
        if len(parts) == 3 and parts[0] == "repos":
            for repo in self.hub.repos.values():
                if repo.cdn and repo.cdn_key == parts[1]:
                    served = next((f for f in repo.files.values() if f.lfs and f.sha256 == parts[2]), None)
        entry.name = served.name if served else None
        if entry.authorized:
            # S3 refuses a signed URL that also carries a token: credentials never go to the CDN.
            self._s3_error(400, "InvalidArgument", "Only one auth mechanism allowed", entry)
            return
        expires, signature = query.get("Expires", [""])[0], query.get("Signature", [""])[0]
        good = hmac.compare_digest(signature.encode(), self.hub._signature(path, expires).encode())
        if not good or not expires.isdigit():
            self._s3_error(403, "SignatureDoesNotMatch", "The request signature is invalid", entry)
            return
        if int(expires) < time.time():
            self._s3_error(403, "AccessDenied", "Request has expired", entry)
            return
        if served is None:
            self._s3_error(404, "NoSuchKey", "The specified key does not exist.", entry)
            return
        headers = {
            "Content-Type": query.get("response-content-type", ["binary/octet-stream"])[0],
            "ETag": f'"{served.md5}"',
            "Accept-Ranges": "bytes",
            "Last-Modified": formatdate(served.path.stat().st_mtime, usegmt=True),
        }
        if "response-content-disposition" in query:
            headers["Content-Disposition"] = query["response-content-disposition"][0]
        self._serve_bytes(served, head, headers, entry)

    def _s3_error(self, status: int, code: str, message: str, entry: Logged) -> None:
        body = f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message></Error>'
        self._send(status, body.encode(), {"Content-Type": "application/xml"}, entry)
