"""`gemmactl list` and `gemmactl rm` through the CLI."""

from __future__ import annotations

import json

from conftest import invoke, run_gemmactl
from gemmactl.store import Artifact, Store


def _add(home, name="demo", inside=True, tmp_path=None):
    store = Store(home)
    folder = store.models_dir / name if inside else tmp_path / "outside"
    folder.mkdir(parents=True, exist_ok=True)
    weights = folder / "model.gguf"
    weights.write_bytes(b"GGUF" + b"\0" * 96)
    store.add(Artifact(name=name, path=str(weights), format="gguf", source="test", revision="abc123", size=100))
    return weights


def test_list_empty_store_says_so_and_writes_nothing(runner, isolated_home):
    result = invoke(runner, ["list"])
    assert result.exit_code == 0
    assert "is empty" in result.output
    assert json.loads(invoke(runner, ["list", "--json"]).output) == []
    assert not isolated_home.exists()


def test_list_shows_entries_as_table_and_json(runner, isolated_home):
    _add(isolated_home)
    table = invoke(runner, ["list"]).output
    assert table.splitlines()[0].split()[:3] == ["NAME", "FORMAT", "SIZE"]
    assert "demo" in table and "gguf" in table
    entries = json.loads(invoke(runner, ["list", "--json"]).output)
    assert entries[0]["name"] == "demo" and entries[0]["size"] == 100 and entries[0]["revision"] == "abc123"


def test_rm_with_yes_removes_entry_and_files(runner, isolated_home):
    weights = _add(isolated_home)
    result = invoke(runner, ["rm", "demo", "--yes", "--json"])
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.output)["removed"]["name"] == "demo"
    assert not weights.exists()
    assert Store(isolated_home).get("demo") is None


def test_rm_without_yes_and_without_a_terminal_refuses(isolated_home):
    weights = _add(isolated_home)
    proc = run_gemmactl(["rm", "demo"])
    assert proc.returncode == 2
    assert "Pass --yes" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert weights.exists() and Store(isolated_home).get("demo") is not None


def test_rm_unknown_entry(runner, isolated_home):
    result = invoke(runner, ["rm", "ghost", "--yes"])
    assert result.exit_code == 2
    assert "no entry named 'ghost'" in result.stderr
    assert "gemmactl list" in result.stderr


def test_rm_keeps_files_outside_the_store(runner, isolated_home, tmp_path):
    weights = _add(isolated_home, inside=False, tmp_path=tmp_path)
    assert invoke(runner, ["rm", "demo", "--yes"]).exit_code == 0
    assert weights.exists()
