"""Tests for the model store: home resolution, manifest CRUD, atomic writes, concurrent writers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gemmactl.store import manifest as store_module
from gemmactl.errors import ModelNotFoundError, StoreEntryNotFoundError, StoreError
from gemmactl.store import Artifact, Store, directory_size, home_dir

REPO_ROOT = Path(__file__).resolve().parent.parent


def make_artifact(store: Store, name: str, size: int = 0, **kw) -> Artifact:
    """Build an artifact whose path lies in the store's models dir."""
    return Artifact(
        name=name,
        path=str(store.models_dir / name),
        format=kw.pop("format", "gguf"),
        source=kw.pop("source", f"hf:google/{name}"),
        revision=kw.pop("revision", None),
        size=size,
        **kw,
    )


# -- home resolution -----------------------------------------------------------------------------


def test_home_prefers_gemmactl_home(monkeypatch, tmp_path):
    monkeypatch.setenv("GEMMACTL_HOME", str(tmp_path / "gh"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert home_dir() == tmp_path / "gh"
    assert Store().home == tmp_path / "gh"


def test_home_uses_xdg_data_home(monkeypatch, tmp_path):
    monkeypatch.delenv("GEMMACTL_HOME", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert home_dir() == tmp_path / "xdg" / "gemmactl"


def test_home_defaults_to_local_share(monkeypatch, tmp_path):
    monkeypatch.delenv("GEMMACTL_HOME", raising=False)
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert home_dir() == tmp_path / ".local" / "share" / "gemmactl"


def test_empty_env_values_count_as_unset(monkeypatch, tmp_path):
    monkeypatch.setenv("GEMMACTL_HOME", "")
    monkeypatch.setenv("XDG_DATA_HOME", "")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert home_dir() == tmp_path / ".local" / "share" / "gemmactl"


def test_store_paths(tmp_path):
    store = Store(tmp_path / "h")
    assert store.models_dir == tmp_path / "h" / "models"
    assert store.manifest_path == tmp_path / "h" / "manifest.json"


# -- artifact ------------------------------------------------------------------------------------


def test_artifact_round_trip():
    artifact = Artifact(
        name="g",
        path="/x/g.gguf",
        format="gguf",
        source="pypi:pkg==1.0",
        revision="abc",
        size=12,
        created="2025-01-01T00:00:00+00:00",
        sha256="ff",
        extra={"k": [1, 2]},
    )
    assert Artifact.from_dict(json.loads(json.dumps(artifact.to_dict()))) == artifact


def test_artifact_created_defaults_to_utc_iso():
    artifact = Artifact(name="g", path="/x", format="hf", source="hf:a/b", revision=None, size=0)
    assert artifact.created.endswith("+00:00")
    assert artifact.extra == {} and artifact.sha256 is None


# -- CRUD ----------------------------------------------------------------------------------------


def test_add_get_list(tmp_path):
    store = Store(tmp_path)
    store.add(make_artifact(store, "zeta", 3))
    store.add(make_artifact(store, "alpha", 1))
    assert [a.name for a in store.list()] == ["alpha", "zeta"]
    assert store.get("zeta").size == 3
    assert store.get("missing") is None
    # A second Store on the same home reads what the first wrote.
    assert Store(tmp_path).get("alpha") == store.get("alpha")


def test_manifest_layout(tmp_path):
    store = Store(tmp_path)
    store.add(make_artifact(store, "a", 5, extra={"x": 1}))
    data = json.loads(store.manifest_path.read_text())
    assert data["format"] == "gemmactl-manifest"
    assert data["version"] == 1
    assert data["artifacts"]["a"]["size"] == 5
    assert data["artifacts"]["a"]["extra"] == {"x": 1}


def test_add_replaces_by_name(tmp_path):
    store = Store(tmp_path)
    store.add(make_artifact(store, "a", 1))
    store.add(make_artifact(store, "a", 2, format="hf"))
    assert len(store.list()) == 1
    assert store.get("a").size == 2 and store.get("a").format == "hf"


def test_resolve(tmp_path):
    store = Store(tmp_path)
    store.add(make_artifact(store, "a"))
    assert store.resolve("a").name == "a"
    with pytest.raises(ModelNotFoundError) as info:
        store.resolve("nope")
    assert "no model named 'nope'" in str(info.value)
    assert str(store.manifest_path) in str(info.value)


def test_remove_deletes_files_inside_models_dir(tmp_path):
    store = Store(tmp_path / "home")
    file_artifact = make_artifact(store, "f.gguf")
    dir_artifact = make_artifact(store, "hfdir", format="hf")
    store.models_dir.mkdir(parents=True)
    Path(file_artifact.path).write_bytes(b"x" * 10)
    (Path(dir_artifact.path) / "sub").mkdir(parents=True)
    (Path(dir_artifact.path) / "sub" / "w.bin").write_bytes(b"y")
    store.add(file_artifact)
    store.add(dir_artifact)

    removed = store.remove("f.gguf")
    assert removed.name == "f.gguf"
    assert not Path(file_artifact.path).exists()
    store.remove("hfdir")
    assert not Path(dir_artifact.path).exists()
    assert store.models_dir.is_dir()
    assert store.list() == []


def test_remove_keeps_files_when_asked(tmp_path):
    store = Store(tmp_path)
    artifact = make_artifact(store, "keep.gguf")
    store.models_dir.mkdir(parents=True)
    Path(artifact.path).write_bytes(b"k")
    store.add(artifact)
    store.remove("keep.gguf", delete_files=False)
    assert Path(artifact.path).exists()
    assert store.get("keep.gguf") is None


def test_remove_never_deletes_outside_the_store(tmp_path):
    store = Store(tmp_path / "home")
    outside = tmp_path / "user-model.gguf"
    outside.write_bytes(b"precious")
    sneaky = store.models_dir / ".." / ".." / "user-model.gguf"
    store.add(Artifact(name="ext", path=str(outside), format="gguf", source="file", revision=None, size=8))
    store.add(Artifact(name="sneaky", path=str(sneaky), format="gguf", source="file", revision=None, size=8))
    store.remove("ext")
    store.remove("sneaky")
    assert outside.read_bytes() == b"precious"
    assert store.list() == []


def test_remove_does_not_follow_symlinks_out_of_the_store(tmp_path):
    store = Store(tmp_path / "home")
    outside_dir = tmp_path / "shared"
    outside_dir.mkdir()
    (outside_dir / "w.bin").write_bytes(b"w")
    store.models_dir.mkdir(parents=True)
    link = store.models_dir / "linked"
    link.symlink_to(outside_dir, target_is_directory=True)
    store.add(Artifact(name="linked", path=str(link), format="hf", source="x", revision=None, size=1))
    store.remove("linked")
    assert not link.exists() and not link.is_symlink()
    assert (outside_dir / "w.bin").read_bytes() == b"w"


def test_remove_unknown_entry(tmp_path):
    store = Store(tmp_path)
    store.add(make_artifact(store, "a"))
    with pytest.raises(StoreEntryNotFoundError) as info:
        store.remove("ghost")
    assert "ghost" in str(info.value)
    assert store.get("a") is not None


# -- manifest health -----------------------------------------------------------------------------


def test_corrupt_manifest_raises(tmp_path):
    store = Store(tmp_path)
    store.manifest_path.write_text('{"format": "gemmactl-manifest", "vers')
    with pytest.raises(StoreError) as info:
        store.list()
    assert str(store.manifest_path) in str(info.value)
    assert "aside" in info.value.hint
    with pytest.raises(StoreError):
        store.add(make_artifact(store, "a"))
    # The failed add must not have overwritten the corrupt file the user may want to inspect.
    assert store.manifest_path.read_text().endswith('"vers')


@pytest.mark.parametrize(
    "document",
    [
        [],
        {"format": "something-else", "version": 1, "artifacts": {}},
        {"format": "gemmactl-manifest", "version": "1", "artifacts": {}},
        {"format": "gemmactl-manifest", "version": 1, "artifacts": []},
        {"format": "gemmactl-manifest", "version": 1, "artifacts": {"a": {"name": "a"}}},
    ],
)
def test_malformed_manifest_raises(tmp_path, document):
    store = Store(tmp_path)
    store.manifest_path.write_text(json.dumps(document))
    with pytest.raises(StoreError):
        store.list()


def test_newer_manifest_version_raises(tmp_path):
    store = Store(tmp_path)
    store.manifest_path.write_text(json.dumps({"format": "gemmactl-manifest", "version": 2, "artifacts": {}}))
    with pytest.raises(StoreError) as info:
        store.get("a")
    assert "upgrade" in (info.value.hint or "").lower()


def test_listing_missing_home_creates_nothing(tmp_path):
    home = tmp_path / "does-not-exist"
    store = Store(home)
    assert store.list() == []
    assert store.get("a") is None
    with pytest.raises(ModelNotFoundError):
        store.resolve("a")
    assert not home.exists()


def test_failed_replace_keeps_old_manifest_and_no_temp(tmp_path, monkeypatch):
    store = Store(tmp_path)
    store.add(make_artifact(store, "old"))
    before = store.manifest_path.read_bytes()

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(store_module.os, "replace", broken_replace)
    with pytest.raises(StoreError):
        store.add(make_artifact(store, "new"))
    monkeypatch.undo()

    assert store.manifest_path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json", "manifest.lock"]
    assert [a.name for a in store.list()] == ["old"]


def test_write_goes_through_a_temp_file_in_the_home(tmp_path, monkeypatch):
    store = Store(tmp_path)
    store.add(make_artifact(store, "old"))
    seen: list[tuple[str, bytes]] = []
    real_replace = os.replace

    def spying_replace(src, dst):
        # At rename time the target still holds the complete old manifest.
        seen.append((os.path.dirname(src), Path(dst).read_bytes()))
        real_replace(src, dst)

    before = store.manifest_path.read_bytes()
    monkeypatch.setattr(store_module.os, "replace", spying_replace)
    store.add(make_artifact(store, "new"))
    assert seen == [(str(tmp_path), before)]
    assert [a.name for a in store.list()] == ["new", "old"]


# -- concurrency ---------------------------------------------------------------------------------

_WRITER = """
import sys
from gemmactl.store import Artifact, Store
store = Store(sys.argv[1])
worker = int(sys.argv[2])
for i in range(25):
    name = f"w{worker}-{i}"
    store.add(Artifact(name=name, path=str(store.models_dir / name), format="gguf",
                       source="test", revision=None, size=i))
"""


def test_concurrent_writers_lose_nothing(tmp_path):
    home = tmp_path / "shared-home"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [
        subprocess.Popen([sys.executable, "-c", _WRITER, str(home), str(w)], env=env, stderr=subprocess.PIPE)
        for w in range(8)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err.decode()
    names = {a.name for a in Store(home).list()}
    assert len(names) == 200
    assert names == {f"w{w}-{i}" for w in range(8) for i in range(25)}
    assert not [p for p in home.iterdir() if p.name.endswith(".tmp")]


# -- helpers -------------------------------------------------------------------------------------


def test_directory_size(tmp_path):
    (tmp_path / "a").write_bytes(b"x" * 10)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b").write_bytes(b"y" * 5)
    assert directory_size(tmp_path) == 15
    assert directory_size(tmp_path / "a") == 10
    assert directory_size(tmp_path / "missing") == 0
