"""Shared fixtures: every test gets its own empty store; real-model tests share one assembled copy."""

from __future__ import annotations

import os
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
    from gemmactl.embedded import ensure_embedded_model
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
    from gemmactl.embedded import embedded_path
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
    from tiny_gemma4 import build_tiny_gemma4

    built: dict[str, Path] = {}

    def make(kind: str) -> Path:
        if kind not in built:
            built[kind] = build_tiny_gemma4(kind, tmp_path_factory.mktemp(f"tiny-{kind}"))
        return built[kind]

    return make
