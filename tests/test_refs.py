"""The one resolver: model references → files, the formats each command takes, and one set of errors."""

from __future__ import annotations

import json

import pytest

from gemmactl.errors import ArtifactMissingError, ModelNotFoundError, StoreError, WrongModelKindError
from gemmactl.store import Artifact, Store
from gemmactl.store.refs import ANY, ARTIFACTS, CHECKPOINTS, RUNNABLE, resolve_model


@pytest.fixture
def store(tmp_path) -> Store:
    return Store(tmp_path / "home")


def gguf_file(path):
    path.write_bytes(b"GGUF" + b"\0" * 60)
    return path


def checkpoint_dir(path):
    path.mkdir()
    (path / "config.json").write_text("{}")
    return path


def test_paths_are_resolved_by_what_they_hold(store, tmp_path):
    gguf = gguf_file(tmp_path / "model.gguf")
    found = resolve_model(str(gguf), store)
    assert (found.path, found.format, found.artifact) == (gguf, "gguf", None)
    assert found.source == f"dir:{gguf.resolve()}" and found.name == "model.gguf"
    ckpt = checkpoint_dir(tmp_path / "ckpt")
    assert resolve_model(str(ckpt), store, accept=CHECKPOINTS).format == "hf"
    assert resolve_model(str(ckpt), store, accept=ANY).format == "hf"


def test_a_folder_without_a_slash_is_a_path_too(store, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    checkpoint_dir(tmp_path / "ckpt")
    assert resolve_model("ckpt", store, accept=CHECKPOINTS).path.name == "ckpt"
    (tmp_path / "empty").mkdir()
    with pytest.raises(WrongModelKindError, match="empty is a directory with no model in it"):
        resolve_model("empty", store)


def test_store_names_win_and_carry_their_entry(store, tmp_path):
    gguf = gguf_file(tmp_path / "x.gguf")
    store.add(Artifact(name="fast-model", path=str(gguf), format="gguf", source="hf:o/r", revision="abc", size=64))
    found = resolve_model("fast-model", store)
    assert found.artifact.name == "fast-model" and found.source == "hf:o/r" and found.revision == "abc"


@pytest.mark.parametrize("accept, found_words, wanted_words", [
    (RUNNABLE, "is a Hugging Face checkpoint folder", "not a GGUF file or an int4-stream artifact"),
    (ARTIFACTS, "is a Hugging Face checkpoint folder", "not an int4-stream artifact"),
])
def test_the_wrong_kind_names_what_it_found_and_what_was_wanted(store, tmp_path, accept, found_words, wanted_words):
    ckpt = checkpoint_dir(tmp_path / "ckpt")
    with pytest.raises(WrongModelKindError) as caught:
        resolve_model(str(ckpt), store, accept=accept)
    assert found_words in caught.value.message and wanted_words in caught.value.message
    assert caught.value.exit_code == 2 and caught.value.hint
    store.add(Artifact(name="pulled", path=str(ckpt), format="hf", source="hf:o/r", revision=None, size=2))
    with pytest.raises(WrongModelKindError, match=r"'pulled' is a Hugging Face checkpoint folder \(config.json \+ \*.safetensors\) in the store"):
        resolve_model("pulled", store, accept=accept)


def test_a_gguf_is_not_a_checkpoint(store, tmp_path):
    with pytest.raises(WrongModelKindError, match="is a GGUF file, not a Hugging Face checkpoint"):
        resolve_model(str(gguf_file(tmp_path / "m.gguf")), store, accept=CHECKPOINTS)


def test_nothing_there(store, tmp_path):
    with pytest.raises(ModelNotFoundError, match="no such model file or folder"):
        resolve_model(str(tmp_path / "gone.gguf"), store)
    with pytest.raises(ModelNotFoundError, match="no model named 'nothing' in the store and no such file or folder"):
        resolve_model("nothing", store)
    with pytest.raises(ArtifactMissingError, match="not in the store yet") as caught:
        resolve_model("deep-model", store, missing_hint="Make it with: gemmactl quantize ...")
    assert caught.value.hint.startswith("Make it with")


def test_an_entry_whose_file_is_gone(store, tmp_path):
    store.add(Artifact(name="lost", path=str(tmp_path / "lost.gguf"), format="gguf", source="x", revision=None, size=1))
    with pytest.raises(StoreError, match="the file is gone") as caught:
        resolve_model("lost", store)
    assert "gemmactl rm lost" in caught.value.hint


def test_a_foreign_or_unfinished_index_is_explained_by_the_reader(store, tmp_path):
    foreign = tmp_path / "other"
    foreign.mkdir()
    (foreign / "index.json").write_text(json.dumps({"format": "something-else", "version": 1}))
    with pytest.raises(Exception, match="something-else index"):
        resolve_model(str(foreign), store, accept=ARTIFACTS)
    unfinished = tmp_path / "half"
    unfinished.mkdir()
    (unfinished / ".int4-stream-partial.json").write_text("{}")
    with pytest.raises(Exception, match="unfinished int4-stream artifact"):
        resolve_model(str(unfinished), store)


@pytest.mark.real_model
def test_embedded_is_assembled_once_and_only_where_gguf_is_wanted(model_home):
    store = Store(model_home)
    found = resolve_model("embedded", store)
    assert found.format == "gguf" and found.artifact.name == "gemma3-270m"
    assert resolve_model("gemma3-270m", store).path == found.path
    with pytest.raises(ModelNotFoundError):
        resolve_model("embedded", store, accept=CHECKPOINTS)
