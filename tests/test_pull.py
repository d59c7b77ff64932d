"""`gemmactl pull` against a stand-in hub on 127.0.0.1 (tests/helpers/hub_server.py); huggingface_hub runs unmocked."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import namedtuple
from pathlib import Path

import pytest

from conftest import invoke
from gemmactl.errors import InvalidRepoIdError, NoFilesSelectedError
from gemmactl.hub.cache import RepoFile
from gemmactl.hub.select import select_files, validate_repo_id
from gemmactl.store import Store
from helpers.hub_server import FakeHub

REPO = "gemmactl-test/tiny-gemma4"
CDN_REPO = "gemmactl-test/tiny-gemma4-cdn"  # the same files; LFS ones redirect to the CDN, as on huggingface.co
GGUF_REPO = "gemmactl-test/tiny-gemma4-GGUF"
GATED_REPO = "gemmactl-test/gated-gemma4"
CHECKPOINT = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]
GGUF_FILES = [
    "tiny-gemma4-Q4_K_M.gguf",
    "tiny-gemma4-Q4_K_S.gguf",
    "tiny-gemma4-Q8_0.gguf",
    "Q6_K/tiny-gemma4-Q6_K-00001-of-00002.gguf",
    "Q6_K/tiny-gemma4-Q6_K-00002-of-00002.gguf",
    "mmproj-tiny-gemma4-F16.gguf",
]


# -- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def fake_hub(tiny_gemma4, tmp_path_factory):
    """One server for the session: the tiny Gemma 4 checkpoint repo, a GGUF repo and a gated repo."""
    checkpoint = tiny_gemma4("dense-ple")
    extra = tmp_path_factory.mktemp("hub-files")
    files = {p.name: p for p in checkpoint.iterdir() if p.is_file()}
    stand_ins = {
        "tokenizer.json": json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {"<pad>": 0}}}).encode(),
        "README.md": b"# tiny gemma 4\n",
        "diagram.png": b"\x89PNG\r\n\x1a\n" + os.urandom(4096),
        "pytorch_model.bin": os.urandom(8192),
    }
    for name, data in stand_ins.items():
        (extra / name).write_bytes(data)
        files[name] = extra / name
    hub = FakeHub()
    lfs = {"model.safetensors", "tokenizer.json", "diagram.png", "pytorch_model.bin"}
    hub.add_repo(REPO, files, lfs=lfs)
    hub.add_repo(CDN_REPO, files, lfs=lfs, cdn=True)

    gguf_files = {"README.md": extra / "README.md"}
    for index, name in enumerate(GGUF_FILES):
        path = extra / name.replace("/", "_")
        path.write_bytes(b"GGUF" + bytes([index]) * 16 + os.urandom(32 * 1024))
        gguf_files[name] = path
    hub.add_repo(GGUF_REPO, gguf_files, lfs=set(GGUF_FILES))

    small = extra / "gated.safetensors"
    small.write_bytes(os.urandom(4096))
    gated_files = {"config.json": files["config.json"], "model.safetensors": small}
    hub.add_repo(GATED_REPO, gated_files, lfs={"model.safetensors"}, gated=True, tokens={"hf_granted"})
    yield hub
    hub.stop()


@pytest.fixture
def hub(fake_hub, tmp_path, monkeypatch) -> FakeHub:
    """The session's hub with its knobs and log reset; HF_ENDPOINT and HF_HOME point at it and a fresh cache."""
    from huggingface_hub import constants

    fake_hub.reset()
    monkeypatch.setenv("HF_ENDPOINT", fake_hub.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    # huggingface_hub's user-agent telemetry would call the endpoint it read at import (the real hub).
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)
    return fake_hub


@pytest.fixture
def cache(tmp_path):
    """Paths inside the test's HF cache: cache(repo) → the repo folder."""
    return lambda repo=REPO: tmp_path / "hf" / "hub" / ("models--" + repo.replace("/", "--"))


def pull(runner, *args):
    return invoke(runner, ["pull", *args])


def pull_json(runner, *args) -> dict:
    result = pull(runner, *args, "--json")
    assert result.exit_code == 0, result.stderr
    return json.loads(result.output)


def bytes_host(hub: FakeHub, repo_id: str, name: str) -> str:
    """Which server sends a file's bytes: the CDN for LFS files of a cdn repo, else the hub itself."""
    repo = hub.repos[repo_id]
    return "cdn" if repo.cdn and repo.files[name].lfs else "hub"


def assert_blobs_match(hub: FakeHub, root: Path, repo_id: str, names) -> None:
    """Each file's cache blob is named by, and hashes to, the hub's checksum of it."""
    repo = hub.repos[repo_id]
    for name in names:
        served = repo.files[name]
        pointer = root / "snapshots" / repo.commit / name
        assert os.path.basename(os.readlink(pointer)) == served.etag
        if served.lfs:
            assert _sha256(pointer) == served.sha256, name
        else:
            data = pointer.read_bytes()
            assert hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() == served.git_oid, name


def assert_one_line_error(result, code: int) -> str:
    assert result.exit_code == code, (result.output, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


# -- the clean path ------------------------------------------------------------------------------


def test_clean_pull_fills_the_standard_cache_and_registers_the_commit(runner, hub, cache, isolated_home):
    repo = hub.repos[REPO]
    out = pull_json(runner, REPO)
    assert out["commit"] == repo.commit and out["kind"] == "safetensors"
    assert [f["name"] for f in out["files"]] == CHECKPOINT
    total = sum(repo.files[name].size for name in CHECKPOINT)
    assert out["total"] == total and out["downloaded"] == total

    # Only the checkpoint's files were fetched: no README, image or other weight format.
    assert sorted(r.file for r in hub.downloads()) == CHECKPOINT
    root = cache()
    assert (root / "refs" / "main").read_text() == repo.commit
    weights = root / "snapshots" / repo.commit / "model.safetensors"
    assert weights.is_symlink() and os.readlink(weights) == f"../../blobs/{repo.files['model.safetensors'].sha256}"
    assert weights.stat().st_size == repo.files["model.safetensors"].size

    entry = Store(isolated_home).get(REPO)
    assert (entry.format, entry.source, entry.revision, entry.size) == ("hf", f"hf:{REPO}", repo.commit, total)
    assert entry.path == str(root / "snapshots" / repo.commit)
    assert [f["name"] for f in entry.extra["files"]] == CHECKPOINT
    assert REPO in invoke(runner, ["list"]).output

    # The cache is the standard one: huggingface_hub and transformers read it without the network.
    from huggingface_hub import hf_hub_download
    from transformers import AutoConfig

    found = hf_hub_download(REPO, "config.json", cache_dir=root.parent, local_files_only=True)
    assert Path(found) == root / "snapshots" / repo.commit / "config.json"
    assert AutoConfig.from_pretrained(entry.path).model_type.startswith("gemma4")

    # A second pull fetches nothing and still checks every file.
    hub.reset()
    again = pull_json(runner, REPO)
    assert again["downloaded"] == 0 and hub.downloads() == []


def test_human_output_names_the_store_entry(runner, hub):
    result = pull(runner, REPO, "--exclude", "*.safetensors")
    assert result.exit_code == 0, result.stderr
    assert f"Store name: {REPO}" in result.output and "checksums verified" in result.output


# -- resume --------------------------------------------------------------------------------------


def assert_fetched_via(hub: FakeHub, repo_id: str, name: str, expected: list[tuple[str | None, int]]) -> None:
    """The file's bytes came as `expected` (range, status) from the right server; on the CDN path each of
    those requests first went to the hub, which answered 302 to the same Range."""
    gets = hub.gets(name)
    assert [(g.range, g.status) for g in gets] == expected
    assert {g.host for g in gets} == {bytes_host(hub, repo_id, name)}
    redirects = hub.redirects(name)
    if bytes_host(hub, repo_id, name) == "cdn":
        assert [(r.method, r.range, r.status) for r in redirects] == [("GET", g.range, 302) for g in gets]
    else:
        assert redirects == []


@pytest.mark.parametrize("repo_id", [REPO, CDN_REPO])
def test_dropped_connection_continues_by_range(runner, hub, cache, isolated_home, repo_id):
    hub.drop_once["model.safetensors"] = 30_000_000
    out = pull_json(runner, repo_id)
    gets = hub.gets("model.safetensors")
    assert len(gets) == 2 and gets[0].range is None
    assert gets[1].range.startswith("bytes=") and int(gets[1].range[6:-1]) > 0
    assert_fetched_via(hub, repo_id, "model.safetensors", [(None, 200), (gets[1].range, 206)])
    assert out["commit"] == hub.repos[repo_id].commit
    assert Store(isolated_home).get(repo_id) is not None
    assert_blobs_match(hub, cache(repo_id), repo_id, CHECKPOINT)


@pytest.mark.parametrize("repo_id", [REPO, CDN_REPO])
def test_rerun_after_a_failed_pull_continues_the_partial_file(runner, hub, cache, isolated_home, repo_id):
    sha = hub.repos[repo_id].files["model.safetensors"].sha256
    hub.drop_once["model.safetensors"] = 30_000_000
    hub.status_after_drop["model.safetensors"] = 503
    line = assert_one_line_error(pull(runner, repo_id), 1)
    assert "HTTP 503" in line
    assert Store(isolated_home).get(repo_id) is None
    partial = cache(repo_id) / "blobs" / f"{sha}.incomplete"
    kept = partial.stat().st_size
    assert 0 < kept < hub.repos[repo_id].files["model.safetensors"].size

    hub.reset()
    pull_json(runner, repo_id)
    assert_fetched_via(hub, repo_id, "model.safetensors", [(f"bytes={kept}-", 206)])
    # Files completed before the failure are not fetched again.
    assert sorted(r.file for r in hub.downloads()) == ["model.safetensors", "tokenizer.json"]
    assert not partial.exists()
    assert_blobs_match(hub, cache(repo_id), repo_id, CHECKPOINT)


@pytest.mark.parametrize("repo_id", [REPO, CDN_REPO])
def test_kill_9_mid_file_then_rerun_continues_by_range(runner, hub, cache, isolated_home, repo_id):
    size = hub.repos[repo_id].files["model.safetensors"].size
    partial = cache(repo_id) / "blobs" / f"{hub.repos[repo_id].files['model.safetensors'].sha256}.incomplete"
    hub.throttle["model.safetensors"] = 20_000_000  # bytes/s: the file takes ~6 s, plenty of time to kill it
    proc = subprocess.Popen(
        [sys.executable, "-m", "gemmactl", "pull", repo_id, "--json"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=dict(os.environ),
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (partial.exists() and partial.stat().st_size >= 20_000_000):
            time.sleep(0.02)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    kept = partial.stat().st_size
    assert 0 < kept < size
    assert Store(isolated_home).get(repo_id) is None

    hub.reset()
    pull_json(runner, repo_id)
    assert_fetched_via(hub, repo_id, "model.safetensors", [(f"bytes={kept}-", 206)])
    assert sorted(r.file for r in hub.downloads()) == ["model.safetensors", "tokenizer.json"]
    assert Store(isolated_home).get(repo_id).revision == hub.repos[repo_id].commit
    assert_blobs_match(hub, cache(repo_id), repo_id, CHECKPOINT)


# A partial file the next pull must not continue by Range: already complete (e.g. killed between the
# last byte and the rename), or bigger than the file on the hub. A Range from its size would start at
# or past the end, which the hub answers 416.
@pytest.mark.parametrize(
    "kind, repo_id", [("complete", REPO), ("too-big", REPO), ("too-big", CDN_REPO), ("complete-but-wrong", CDN_REPO)]
)
def test_a_partial_file_at_or_past_the_end_is_never_continued_past_it(runner, hub, cache, isolated_home, repo_id, kind):
    served = hub.repos[repo_id].files["model.safetensors"]
    partial = cache(repo_id) / "blobs" / f"{served.sha256}.incomplete"
    partial.parent.mkdir(parents=True)
    data = bytearray(served.path.read_bytes())
    if kind == "too-big":
        data += os.urandom(4096)
    elif kind == "complete-but-wrong":
        data[len(data) // 3] ^= 0xFF
    partial.write_bytes(bytes(data))

    result = pull(runner, repo_id, "--json")
    assert all(r.status != 416 for r in hub.requests), [(r.host, r.path, r.range, r.status) for r in hub.requests]
    if kind == "complete":
        assert result.exit_code == 0, result.stderr
        assert hub.gets("model.safetensors") == [] and hub.redirects("model.safetensors") == []
        others = [hub.repos[repo_id].files[name] for name in CHECKPOINT if name != "model.safetensors"]
        assert json.loads(result.output)["downloaded"] == sum(f.size for f in others)
    elif kind == "too-big":
        assert result.exit_code == 0, result.stderr
        assert_fetched_via(hub, repo_id, "model.safetensors", [(None, 200)])  # from the start, not by Range
    else:
        # Complete in size, so nothing is fetched; the checksum catches it and the bad bytes go.
        line = assert_one_line_error(result, 1)
        assert "checksum mismatch" in line and "model.safetensors (sha256)" in line
        assert hub.gets("model.safetensors") == [] and not partial.exists()
        assert Store(isolated_home).get(repo_id) is None
        hub.reset()
        pull_json(runner, repo_id)
        assert_fetched_via(hub, repo_id, "model.safetensors", [(None, 200)])
    assert not partial.exists()
    assert_blobs_match(hub, cache(repo_id), repo_id, CHECKPOINT)
    assert Store(isolated_home).get(repo_id).revision == hub.repos[repo_id].commit


# -- LFS files behind a CDN redirect, as on huggingface.co -----------------------------------------


def _http(url: str, range_: str | None = None, token: str | None = None, method: str = "GET"):
    """One request, redirects not followed, with huggingface_hub's HTTP library."""
    import httpx2

    headers = {"Range": range_} if range_ else {}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    with httpx2.Client(follow_redirects=False) as client:
        return client.request(method, url, headers=headers)


def test_the_cdn_redirect_carries_what_huggingface_hub_reads(hub, tmp_path):
    from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url
    from huggingface_hub.utils._runtime import is_xet_available

    repo = hub.repos[CDN_REPO]
    served = repo.files["model.safetensors"]
    url = hf_hub_url(CDN_REPO, "model.safetensors", endpoint=hub.url)
    meta = get_hf_file_metadata(url, token="hf_user", endpoint=hub.url)
    assert (meta.commit_hash, meta.etag, meta.size) == (repo.commit, served.sha256, served.size)
    assert meta.location.startswith(hub.cdn_url + "/") and meta.xet_file_data is None
    # The 302 to another origin is not followed by the metadata call: it carries everything.
    assert [(r.method, r.host, r.status, r.authorized) for r in hub.requests] == [("HEAD", "hub", 302, True)]

    # The signed URL serves ranges without credentials, and refuses them, or a missing signature.
    part = _http(meta.location, "bytes=0-15")
    with open(served.path, "rb") as source:
        assert part.status_code == 206 and part.content == source.read(16)
    assert part.headers["Content-Range"] == f"bytes 0-15/{served.size}"
    assert part.headers["ETag"].strip('"') != served.sha256  # a CDN's own ETag, never the hub's
    assert _http(meta.location, "bytes=0-15", token="hf_user").status_code == 400
    assert _http(meta.location.split("?")[0], "bytes=0-15").status_code == 403

    # huggingface_hub's own download takes the bytes from the CDN, without the token; with hf_xet
    # installed, only the hub's silence about Xet keeps it on plain HTTP.
    assert is_xet_available()
    hub.reset()
    path = hf_hub_download(CDN_REPO, "model.safetensors", cache_dir=tmp_path / "hf-cache", endpoint=hub.url,
                           token="hf_user")
    assert [(r.method, r.host, r.status, r.authorized) for r in hub.requests] == [
        ("HEAD", "hub", 302, True), ("GET", "cdn", 200, False)]
    assert os.path.basename(os.path.realpath(path)) == served.sha256
    assert _sha256(Path(path)) == served.sha256


def test_pull_through_the_cdn_keeps_the_token_on_the_hub_and_checksums_match(runner, hub, cache, isolated_home):
    repo = hub.repos[CDN_REPO]
    out = pull_json(runner, CDN_REPO, "--token", "hf_user")
    assert out["commit"] == repo.commit and [f["name"] for f in out["files"]] == CHECKPOINT
    assert {bytes_host(hub, CDN_REPO, name) for name in CHECKPOINT} == {"hub", "cdn"}
    for name in CHECKPOINT:
        assert_fetched_via(hub, CDN_REPO, name, [(None, 200)])
    # The token went with every hub request and with no CDN one (which the CDN would answer 400).
    assert all(r.authorized for r in hub.requests if r.host == "hub")
    assert not any(r.authorized for r in hub.requests if r.host == "cdn")
    assert_blobs_match(hub, cache(CDN_REPO), CDN_REPO, CHECKPOINT)
    entry = Store(isolated_home).get(CDN_REPO)
    assert entry.revision == repo.commit and entry.path == str(cache(CDN_REPO) / "snapshots" / repo.commit)


def test_a_cdn_refusing_an_expired_link_is_not_called_a_gated_repo(runner, hub, cache, isolated_home):
    hub.url_ttl = -60  # every signed link has expired by the time it is used
    line = assert_one_line_error(pull(runner, CDN_REPO), 1)
    assert f"download server {hub.cdn_url} answered HTTP 403" in line and "Rerun" in line
    assert "gated" not in line and "HF_TOKEN" not in line and "license" not in line
    assert [(g.host, g.status) for g in hub.gets("model.safetensors")] == [("cdn", 403)]
    assert Store(isolated_home).get(CDN_REPO) is None

    hub.reset()  # fresh links
    pull_json(runner, CDN_REPO)
    assert_blobs_match(hub, cache(CDN_REPO), CDN_REPO, CHECKPOINT)


@pytest.mark.parametrize(
    "repo_id, name", [(REPO, "config.json"), (REPO, "model.safetensors"), (CDN_REPO, "model.safetensors")]
)
def test_ranges_and_a_range_past_the_end(hub, tmp_path, repo_id, name):
    from huggingface_hub import hf_hub_url
    from huggingface_hub.errors import HfHubHTTPError
    from huggingface_hub.file_download import http_get

    served = hub.repos[repo_id].files[name]
    size = served.size
    url = hf_hub_url(repo_id, name, revision=hub.repos[repo_id].commit, endpoint=hub.url)
    head = _http(url, method="HEAD")
    if bytes_host(hub, repo_id, name) == "cdn":
        assert head.status_code == 302
        bytes_url = head.headers["Location"]
    else:
        assert head.status_code == 200 and int(head.headers["Content-Length"]) == size
        bytes_url = url
    cases = [
        (f"bytes={size}-", 416, None),
        (f"bytes={size + 7}-", 416, None),
        (f"bytes={size}-{size + 9}", 416, None),
        ("bytes=-0", 416, None),
        (f"bytes={size - 1}-", 206, (size - 1, size)),
        ("bytes=0-9", 206, (0, 10)),
        ("bytes=-10", 206, (size - 10, size)),
        (f"bytes={size - 5}-{size + 100}", 206, (size - 5, size)),
    ]
    for range_, status, span in cases:
        response = _http(bytes_url, range_)
        assert response.status_code == status, range_
        if status == 416:
            assert response.headers["Content-Range"] == f"bytes */{size}", range_
        else:
            start, end = span
            assert response.headers["Content-Range"] == f"bytes {start}-{end - 1}/{size}", range_
            with open(served.path, "rb") as source:
                source.seek(start)
                assert response.content == source.read(end - start), range_

    # What a client continuing from a partial file bigger than the remote one gets; from one exactly as
    # big, huggingface_hub sends nothing at all.
    with open(tmp_path / "partial", "wb") as handle:
        with pytest.raises(HfHubHTTPError) as caught:
            http_get(url, handle, resume_size=size + 7)
        assert caught.value.response.status_code == 416
        hub.reset()
        http_get(url, handle, resume_size=size, expected_size=size)
        assert hub.requests == []


def test_the_hub_never_advertises_xet(hub):
    """Xet needs a CAS server this stand-in does not have: no header, link, listing field or token route names it."""
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils._xet import parse_xet_file_data_from_response

    for repo_id in (REPO, CDN_REPO):
        repo = hub.repos[repo_id]
        listing = _http(f"{hub.url}/api/models/{repo_id}/revision/main?blobs=true")
        assert listing.status_code == 200 and "xet" not in listing.text.lower()
        assert _http(f"{hub.url}/api/models/{repo_id}/xet-read-token/{repo.commit}").status_code == 404
        for name in ("config.json", "model.safetensors"):
            url = hf_hub_url(repo_id, name, revision=repo.commit, endpoint=hub.url)
            responses = [_http(url, method="HEAD"), _http(url, "bytes=0-15")]
            if responses[0].status_code == 302:
                location = responses[0].headers["Location"]
                responses += [_http(location, method="HEAD"), _http(location, "bytes=0-15")]
            for response in responses:
                assert not [key for key in response.headers if key.lower().startswith("x-xet")], dict(response.headers)
                assert "xet" not in response.headers.get("Link", "").lower()
                assert parse_xet_file_data_from_response(response, endpoint=hub.url) is None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


# -- verification --------------------------------------------------------------------------------


def test_same_size_corrupted_bytes_are_caught_deleted_and_nothing_registered(runner, hub, cache, isolated_home):
    hub.corrupt.add("model.safetensors")
    line = assert_one_line_error(pull(runner, REPO), 1)
    assert "checksum mismatch" in line and "model.safetensors (sha256)" in line and "nothing was registered" in line
    sha = hub.repos[REPO].files["model.safetensors"].sha256
    blobs = cache() / "blobs"
    assert not (blobs / sha).exists() and not (blobs / f"{sha}.incomplete").exists()
    assert not (cache() / "snapshots" / hub.repos[REPO].commit / "model.safetensors").exists()
    assert Store(isolated_home).list() == []


def test_verify_a_good_then_a_tampered_cache(runner, hub, cache):
    small = ("--exclude", "*.safetensors")
    pull_json(runner, REPO, *small)
    hub.reset()
    result = pull(runner, REPO, *small, "--verify")
    assert result.exit_code == 0, result.stderr
    assert "every checksum matches" in result.output
    assert hub.requests == []  # an existing pull is checked against the listing saved when it was pulled

    blob = cache() / "blobs" / hub.repos[REPO].files["tokenizer.json"].sha256
    _flip_first_byte(blob)
    line = assert_one_line_error(pull(runner, REPO, *small, "--verify"), 1)
    assert "tokenizer.json (sha256)" in line
    assert not blob.exists()
    pull_json(runner, REPO, *small)
    assert [r.file for r in hub.downloads()] == ["tokenizer.json"]


def test_a_rerun_hashes_changed_files_and_verify_hashes_all(runner, hub, cache):
    small = ("--exclude", "*.safetensors")
    pull_json(runner, REPO, *small)
    blob = cache() / "blobs" / hub.repos[REPO].files["tokenizer.json"].sha256
    _flip_first_byte(blob)  # a new mtime: the rerun hashes it again and catches it
    assert "tokenizer.json (sha256)" in assert_one_line_error(pull(runner, REPO, *small), 1)
    assert not blob.exists()

    pull_json(runner, REPO, *small)
    stamp = blob.stat()
    _flip_first_byte(blob)
    os.utime(blob, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))  # same size, mtime and inode: trusted by a rerun
    assert pull(runner, REPO, *small).exit_code == 0
    assert "tokenizer.json (sha256)" in assert_one_line_error(pull(runner, REPO, *small, "--verify"), 1)


def _flip_first_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF
    with open(path, "r+b") as handle:  # in place: same inode, same size
        handle.write(bytes(data))


# -- bad input and refusals ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "repo_id", ["not a repo", "a/b/c", "https://huggingface.co/google/gemma-4-E2B-it", "owner/-name", "owner/na..me", "x/"]
)
def test_malformed_repo_id_exits_2_without_network(runner, hub, repo_id):
    line = assert_one_line_error(pull(runner, repo_id), 2)
    assert "is not a hub repo id" in line and "OWNER/NAME" in line
    assert hub.requests == []


def test_unknown_repo_exits_2(runner, hub, isolated_home):
    line = assert_one_line_error(pull(runner, "gemmactl-test/no-such-model"), 2)
    assert "no repo gemmactl-test/no-such-model" in line
    assert not isolated_home.joinpath("manifest.json").exists()


def test_unknown_revision_exits_2(runner, hub):
    line = assert_one_line_error(pull(runner, REPO, "--revision", "no-such-branch"), 2)
    assert "has no revision 'no-such-branch'" in line


def test_gated_repo_says_accept_the_license_and_set_hf_token(runner, hub, cache, isolated_home, monkeypatch):
    line = assert_one_line_error(pull(runner, GATED_REPO), 1)
    assert "gated" in line and "Accept the license" in line and "HF_TOKEN" in line
    assert Store(isolated_home).list() == []
    blobs = cache(GATED_REPO) / "blobs"
    assert not blobs.exists() or list(blobs.iterdir()) == []

    assert pull(runner, GATED_REPO, "--token", "hf_granted").exit_code == 0
    monkeypatch.setenv("HF_TOKEN", "hf_granted")
    hub.reset()
    assert pull(runner, GATED_REPO).exit_code == 0
    assert all(r.authorized for r in hub.requests)


def test_no_network_is_one_line(runner, hub, monkeypatch, isolated_home):
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    line = assert_one_line_error(pull(runner, REPO), 1)
    assert f"cannot reach the hub at http://127.0.0.1:{port}" in line
    assert not isolated_home.joinpath("manifest.json").exists()


def test_disk_space_refusal_before_any_download(runner, hub, monkeypatch, isolated_home):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr("shutil.disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
    line = assert_one_line_error(pull(runner, REPO), 1)
    assert re.search(r"needs \d+\.\d MiB more", line) and "1000 B free" in line and "HF_HOME" in line
    assert hub.downloads() == [] and Store(isolated_home).list() == []

    dry = pull(runner, REPO, "--dry-run")
    assert_one_line_error(dry, 1)
    assert "model.safetensors" in dry.output  # the listing is still shown


def test_dry_run_and_verify_do_not_go_together(runner, hub):
    assert "do not go together" in assert_one_line_error(pull(runner, REPO, "--dry-run", "--verify"), 2)


# -- selection -----------------------------------------------------------------------------------


def test_dry_run_lists_files_sizes_total_and_downloads_nothing(runner, hub, cache, isolated_home):
    out = pull_json(runner, REPO, "--dry-run")
    repo = hub.repos[REPO]
    assert [(f["name"], f["size"], f["cached"]) for f in out["files"]] == [
        (name, repo.files[name].size, False) for name in CHECKPOINT
    ]
    assert out["total"] == out["to_download"] == sum(repo.files[n].size for n in CHECKPOINT)
    assert out["enough_space"] is True
    assert hub.downloads() == [] and not cache().exists() and Store(isolated_home).list() == []

    table = pull(runner, REPO, "--dry-run").output
    assert "FILE" in table and "model.safetensors" in table and "README.md" not in table


def test_include_adds_and_exclude_removes(runner, hub):
    out = pull_json(runner, REPO, "--include", "README.md", "--exclude", "*.safetensors", "--exclude", "tokenizer*")
    assert [f["name"] for f in out["files"]] == ["README.md", "config.json", "generation_config.json"]
    assert sorted(r.file for r in hub.downloads()) == ["README.md", "config.json", "generation_config.json"]


def test_gguf_repo_takes_only_the_asked_quant(runner, hub, isolated_home):
    from gemmactl.store.refs import resolve_model

    out = pull_json(runner, GGUF_REPO)
    assert [f["name"] for f in out["files"]] == ["tiny-gemma4-Q4_K_M.gguf"] and out["quant"] == "Q4_K_M"
    split = pull_json(runner, GGUF_REPO, "--quant", "q6_k")
    assert [f["name"] for f in split["files"]] == GGUF_FILES[3:5]
    store = Store(isolated_home)
    entry = store.get(f"{GGUF_REPO}:Q6_K")
    assert entry.format == "gguf" and entry.path.endswith("tiny-gemma4-Q6_K-00001-of-00002.gguf")
    assert resolve_model(f"{GGUF_REPO}:Q4_K_M", store).path.name == "tiny-gemma4-Q4_K_M.gguf"

    line = assert_one_line_error(pull(runner, GGUF_REPO, "--quant", "Q5_K_M"), 2)
    assert "no Q5_K_M GGUF file" in line and "Q4_K_M" in line and "Q8_0" in line


@pytest.mark.parametrize("reference", [f"{GGUF_REPO}:q6_k", f"hf.co/{GGUF_REPO}:Q6_K", f"huggingface.co/{GGUF_REPO}:Q6_K"])
def test_one_string_pulls_name_the_quant(runner, hub, isolated_home, reference):
    out = pull_json(runner, reference)
    assert out["repo"] == GGUF_REPO and out["quant"] == "Q6_K" and [f["name"] for f in out["files"]] == GGUF_FILES[3:5]
    assert Store(isolated_home).get(f"{GGUF_REPO}:Q6_K") is not None


def test_one_string_quant_must_agree_with_the_flag(runner, hub):
    line = assert_one_line_error(pull(runner, f"{GGUF_REPO}:Q6_K", "--quant", "Q8_0"), 2)
    assert "Q6_K" in line and "Q8_0" in line
    assert "names no quantization" in assert_one_line_error(pull(runner, f"{GGUF_REPO}:"), 2)
    assert hub.requests == []


def _listing(*names: str) -> list[RepoFile]:
    return [RepoFile(name, 10, blob_id="0" * 40) for name in names]


@pytest.mark.parametrize(
    "names, quant, expected",
    [
        (("model.gguf-Q4_K_M.gguf",), None, ["model.gguf-Q4_K_M.gguf"]),
        (("m-Q4_K_M.gguf", "m-Q4_K_S.gguf", "m-IQ4_XS.gguf", "mmproj-Q4_K_M.gguf"), None, ["m-Q4_K_M.gguf"]),
        (("m-Q4_K_M.gguf", "m-IQ4_XS.gguf"), "iq4_xs", ["m-IQ4_XS.gguf"]),
        (("m.Q8_0-00001-of-00002.gguf", "m.Q8_0-00002-of-00002.gguf", "m.Q4_K_M.gguf"), "Q8_0",
         ["m.Q8_0-00001-of-00002.gguf", "m.Q8_0-00002-of-00002.gguf"]),
        (("a.safetensors", "config.json", "m-Q4_K_M.gguf"), None, ["a.safetensors", "config.json"]),
        (("a.safetensors", "config.json", "m-Q4_K_M.gguf"), "Q4_K_M", ["m-Q4_K_M.gguf"]),
        (("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
          "pytorch_model.bin", "model.onnx", "flax_model.msgpack", "tf_model.h5", "original/consolidated.pth",
          "onnx/model.safetensors", "chat_template.jinja", "tokenizer.model", "logo.png", "README.md"), None,
         ["chat_template.jinja", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
          "model.safetensors.index.json", "tokenizer.model"]),
    ],
)
def test_select_files(names, quant, expected):
    assert [f.name for f in select_files(_listing(*names), quant=quant).files] == expected


@pytest.mark.parametrize(
    "names, quant, message",
    [
        (("m-Q4_K_M.gguf", "m-Q4_K_S.gguf"), "Q4_K", "no Q4_K GGUF file (it has: Q4_K_M, Q4_K_S)"),
        (("m.Q8_0-00001-of-00003.gguf", "m.Q8_0-00003-of-00003.gguf"), "Q8_0", "lists only 2 of the 3 shards"),
        (("a.safetensors",), "Q4_K_M", "--quant applies to GGUF repos"),
        (("README.md", "model.bin"), None, "neither safetensors weights nor GGUF files"),
    ],
)
def test_select_files_refusals(names, quant, message):
    with pytest.raises(NoFilesSelectedError, match=message.replace("(", r"\(").replace(")", r"\)")):
        select_files(_listing(*names), quant=quant)


@pytest.mark.parametrize("repo_id", ["google/gemma-4-E2B-it", "gpt2", "unsloth/gemma-3-270m-it-GGUF", "a_b/c.d"])
def test_valid_repo_ids(repo_id):
    assert validate_repo_id(repo_id) == repo_id


def test_invalid_repo_id_raises():
    with pytest.raises(InvalidRepoIdError):
        validate_repo_id("owner--x/name")


# -- offline -------------------------------------------------------------------------------------


def test_offline_names_exactly_the_missing_files(runner, hub, monkeypatch, isolated_home):
    pull_json(runner, REPO, "--exclude", "*.safetensors")
    hub.reset()
    line = assert_one_line_error(pull(runner, REPO, "--offline"), 1)
    assert line.startswith(f"Error: the cache lacks 1 of the 4 files of {REPO}@") and line.count(".safetensors") == 1
    assert "model.safetensors" in line and "without --offline" in line

    # Complete for what is asked: registers from the cache alone, HF_HUB_OFFLINE works like --offline.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    Store(isolated_home).remove(REPO)
    out = pull_json(runner, REPO, "--exclude", "*.safetensors")
    assert out["from_cache"] is True and Store(isolated_home).get(REPO).revision == hub.repos[REPO].commit
    assert hub.requests == []


def test_offline_without_any_pull_says_so(runner, hub):
    line = assert_one_line_error(pull(runner, REPO, "--offline"), 1)
    assert "offline, and the cache at" in line and f"has no 'main' of {REPO}" in line


# -- rm --purge ----------------------------------------------------------------------------------


def test_rm_purge_deletes_only_what_no_other_entry_uses(runner, hub, cache, isolated_home):
    files = hub.repos[GGUF_REPO].files
    pull_json(runner, GGUF_REPO, "--include", "README.md")
    pull_json(runner, GGUF_REPO, "--quant", "Q8_0", "--include", "README.md")
    blobs = cache(GGUF_REPO) / "blobs"

    result = invoke(runner, ["rm", f"{GGUF_REPO}:Q4_K_M", "--yes", "--purge", "--json"])
    assert result.exit_code == 0, result.stderr
    purged = json.loads(result.output)["purged"]
    assert purged == {"files": 1, "bytes": files["tiny-gemma4-Q4_K_M.gguf"].size}
    assert not (blobs / files["tiny-gemma4-Q4_K_M.gguf"].sha256).exists()
    assert (blobs / files["tiny-gemma4-Q8_0.gguf"].sha256).exists()
    assert (blobs / files["README.md"].git_oid).exists()  # still used by the Q8_0 entry
    entry = Store(isolated_home).get(f"{GGUF_REPO}:Q8_0")
    assert Path(entry.path).read_bytes()[:4] == b"GGUF"

    result = invoke(runner, ["rm", f"{GGUF_REPO}:Q8_0", "--yes", "--purge"])
    assert result.exit_code == 0 and "purged 2 cache files" in result.output
    assert not cache(GGUF_REPO).exists()


def test_rm_purge_keeps_blobs_another_cached_snapshot_links(runner, hub, cache, isolated_home):
    repo = hub.repos[REPO]
    repo.branches["v2"] = "b" * 40  # a second commit with the same files, hence the same blobs
    try:
        pull_json(runner, REPO, "--exclude", "*.safetensors")
        pull_json(runner, REPO, "--exclude", "*.safetensors", "--revision", "v2")  # replaces the entry
    finally:
        del repo.branches["v2"]
    assert Store(isolated_home).get(REPO).revision == "b" * 40
    result = invoke(runner, ["rm", REPO, "--yes", "--purge", "--json"])
    assert json.loads(result.output)["purged"] == {"files": 0, "bytes": 0}
    assert not (cache() / "snapshots" / ("b" * 40)).exists() and not (cache() / "refs" / "v2").exists()
    assert (cache() / "snapshots" / repo.commit / "config.json").read_bytes() == repo.files["config.json"].path.read_bytes()


def test_rm_without_purge_keeps_the_cache(runner, hub, cache):
    pull_json(runner, GGUF_REPO)
    assert invoke(runner, ["rm", f"{GGUF_REPO}:Q4_K_M", "--yes"]).exit_code == 0
    assert (cache(GGUF_REPO) / "blobs" / hub.repos[GGUF_REPO].files["tiny-gemma4-Q4_K_M.gguf"].sha256).exists()


def test_disk_full_and_timeouts_become_one_line_errors():
    import errno

    from gemmactl.errors import DiskSpaceError, HubUnreachableError
    from gemmactl.hub.pull import _translate

    full = _translate(OSError(errno.ENOSPC, "No space left on device"), REPO, "main", "http://hub", Path("/cache"))
    assert isinstance(full, DiskSpaceError) and "/cache" in full.message
    slow = _translate(TimeoutError("timed out"), REPO, "main", "http://hub", Path("/cache"))
    assert isinstance(slow, HubUnreachableError) and slow.message == "the connection to the hub at http://hub broke: timed out"
    assert _translate(ValueError("a bug"), REPO, "main", "http://hub", Path("/cache")) is None


@pytest.mark.parametrize(
    "answered, by_the_hub",
    [
        ("https://huggingface.co/google/gemma-4-E2B-it/resolve/main/model.safetensors", True),
        ("https://hf.co/google/gemma-4-E2B-it/resolve/main/model.safetensors", True),
        ("https://cas-bridge.xethub.hf.co/xet-bridge-us/0123/4567?X-Amz-Signature=89ab", False),
        ("https://cdn-lfs.hf.co/repos/01/23/4567?Expires=1&Signature=89ab", False),
    ],
)
def test_a_403_is_about_access_only_when_the_hub_itself_answers_it(answered, by_the_hub):
    import httpx2
    from huggingface_hub.errors import HfHubHTTPError

    from gemmactl.errors import HubAccessError, HubError
    from gemmactl.hub.pull import _translate

    response = httpx2.Response(403, request=httpx2.Request("GET", answered))
    mapped = _translate(HfHubHTTPError("403 Forbidden", response=response), REPO, "main", "https://huggingface.co",
                        Path("/cache"))
    assert type(mapped) is (HubAccessError if by_the_hub else HubError)


@pytest.mark.parametrize("offline", [False, True])
def test_verify_of_a_repo_never_pulled_says_so_without_the_network(runner, hub, offline):
    args = [REPO, "--verify"] + (["--offline"] if offline else [])
    line = assert_one_line_error(pull(runner, *args), 2)
    assert "never pulled here" in line and f"gemmactl pull {REPO}" in line
    assert hub.requests == []
